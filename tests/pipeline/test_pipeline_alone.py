"""The rollout pipeline driven with a fake driver and no trainer: what crosses the seam is only what
``grpokit.pipeline.driver.RolloutDriver`` declares (a scripted sampler, one process, fixed log-probs)."""

from __future__ import annotations

import contextlib
import inspect

import torch
from datasets import Dataset
from runs import run_args
from tiny import tiny_model, tiny_tokenizer

from grpokit.algorithms.advantages import group_advantages
from grpokit.pipeline import (
    BatchFinisher,
    GroupFilter,
    PromptOrder,
    PromptStream,
    RolloutDriver,
    RolloutPipeline,
    RolloutScorer,
)
from grpokit.rollout.base import Generation, completion_mask_from_eos


class FakeDriver:
    """One process; completions scripted: a prompt containing "same" gets one reply for every row of its group (no
    reward spread), any other prompt a reply as long as the row's place in its group plus one."""

    device = torch.device("cpu")
    process_index, num_processes, lockstep = 0, 1, False
    trainer_state = None

    def __init__(self, tokenizer, group: int):
        self.tok, self.group, self.calls = tokenizer, group, []

    @property
    def version(self) -> int:
        return 0

    def generate(self, prompts, max_new_tokens=None) -> Generation:
        self.calls.append(prompts.ids.shape[0])
        texts = self.tok.batch_decode(prompts.ids, skip_special_tokens=True)
        rows = []
        for i, text in enumerate(texts):
            reply = "x" if "same" in text else "ab" * (1 + i % self.group)
            rows.append(self.tok(reply, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.tok.pad_token_id] * (width - len(r)) for r in rows])
        mask, truncated = completion_mask_from_eos(ids, [self.tok.eos_token_id])
        return Generation(ids, mask, truncated)

    def generation_batch(self):
        return contextlib.nullcontext()

    def policy_logps(self, prompt_ids, prompt_mask, completion_ids, completion_mask, vision=None, **kw):
        return torch.full(completion_ids.shape, -1.0)

    def reference_logps(self, prompt_ids, prompt_mask, completion_ids, completion_mask, vision=None):
        return torch.full(completion_ids.shape, -1.0)

    def gather(self, tensor):
        return tensor

    def sum_over_processes(self, tensor):
        return tensor

    def gather_objects(self, obj):
        return [obj]

    def any_process(self, flag: bool) -> bool:
        return flag

    def stop_together(self, cause):
        assert cause is None


def reply_length(completions, **kw):
    return [float(len(c[0]["content"])) for c in completions]


def pipeline_for(prompts: list[str], group: int = 4, **kw):
    tok = tiny_tokenizer()
    args = run_args("unused", num_generations=group, per_device_train_batch_size=group * 2, **kw)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    weights = torch.ones(1)
    scorer = RolloutScorer(tiny_model(tok), tok, [reply_length], [None], args)
    order = PromptOrder(len(dataset), 2, False, 0)
    group_filter = GroupFilter(args, weights, tok.pad_token_id) if args.dynamic_sampling else None
    prompts = PromptStream(dataset, order, args, weights) if args.dynamic_sampling else None
    finisher = BatchFinisher(args, ["reply_length"], weights, reuses_batches=False)
    return RolloutPipeline(scorer, finisher, group_filter, order, prompts=prompts), FakeDriver(tok, group), dataset


def test_the_fake_driver_offers_what_the_protocol_declares():
    halves = [c for c in RolloutDriver.__mro__ if c.__name__ in ("SamplingDriver", "FinishingDriver")]
    assert len(halves) == 2  # both halves of the seam
    declared = {n for c in halves for n in vars(c) if not n.startswith("_")} | {
        n for c in halves for n in c.__annotations__}
    assert declared <= set(dir(FakeDriver)), sorted(declared - set(dir(FakeDriver)))
    sig = inspect.signature(RolloutDriver.policy_logps)
    assert {"record_routes", "force_routes", "support", "on_support"} <= set(sig.parameters)


def test_rows_to_a_finished_batch_on_a_fake_driver():
    pipeline, driver, dataset = pipeline_for(["first question", "second question"])
    rows = [dataset[i] for i in (0, 1) for _ in range(4)]
    batch, stats = pipeline.next_batch(rows, driver)
    lengths = batch.completion_mask.sum(1).float()
    assert lengths.tolist() == [3.0, 5.0, 7.0, 9.0] * 2  # "ab" × (1..4) and the end-of-sequence token
    rewards = torch.tensor([2.0, 4.0, 6.0, 8.0] * 2).unsqueeze(1)
    expected = group_advantages(rewards, 4, reward_weights=torch.ones(1), scale_rewards="group").advantages
    torch.testing.assert_close(batch.advantages, expected)
    assert batch.num_items_in_batch.item() == lengths.sum().item()
    assert batch.old_logps is None and batch.sampler_routes is None  # on-policy, the sampler is the trainer
    assert driver.calls == [8] and dict(stats.metrics)["reward"] == 5.0


def test_dynamic_sampling_refills_on_a_fake_driver():
    """Groups without reward spread ("same") are dropped and the refill stream supplies others until the batch is
    full; the filter's refill position is the pipeline's state."""
    prompts = ["same one", "differs one", "same two", "differs two", "differs three", "differs four"]
    pipeline, driver, dataset = pipeline_for(prompts, dynamic_sampling=True, dynamic_sampling_max_rounds=5)
    rows = [dataset[i] for i in (0, 1) for _ in range(4)]
    samples, stats = pipeline.sample(rows, driver)
    assert len(samples) == 8
    groups = samples.rewards.view(-1, 4, 1)[..., 0]
    assert all(len(set(g.tolist())) > 1 for g in groups)  # every kept group has spread
    assert all("same" not in p[0]["content"] for p in samples.prompts)
    assert len(driver.calls) >= 2 and pipeline.state_dict()["refill_position"] > 0
