"""Partial rollouts (partial_rollouts=True, grpokit/pipeline/partial.py): a completion that straddles a weight update
has each version's own log-probs token by token (the producer's real parts, with weights published every three
tokens; and through GRPOTrainer with the thread producer and with a rollout worker), no token is older than
max_staleness allows, a resumed run loses no prompt and trains none twice, and what partial rollouts do not continue
is refused in one line."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from datasets import Dataset
from runs import run_args
from tiny import tiny_model, tiny_tokenizer
from transformers import TrainerCallback

from grpokit.forward.logprobs import completion_logps
from grpokit.pipeline.producer import AsyncRollouts, SamplerDriver
from grpokit.pipeline.prompts import BatchRows
from grpokit.pipeline.stats import RolloutStats
from grpokit.trainer import GRPOTrainer


def eos_model(tok, bias=3.5, seed=0):
    """A tiny model whose LM head favours the end-of-sequence token (a bias): lengths spread from 1 to the budget."""
    model = tiny_model(tok, tie=False, seed=seed)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = bias
    model.lm_head = head
    return model


def dataset(n=64):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)]})


def chars(completions, **kw):
    return [len(set(c[0]["content"])) / 8 for c in completions]


def make(out, model=None, **kw):
    tok = tiny_tokenizer()
    settings = {"max_completion_length": 24, "max_steps": 6, "learning_rate": 5e-2, "max_staleness": 2,
                "partial_rollouts": True, "per_device_train_batch_size": 16, **kw}
    return GRPOTrainer(model or eos_model(tok), chars, args=run_args(out, **settings), train_dataset=dataset(),
                       processing_class=tok)


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def gaps_by_version(model, weights: dict[int, dict], samples, behaviour, versions) -> dict[int, float]:
    """For every version ``u`` that sampled tokens: the largest gap, over those tokens, between the behaviour
    log-probs and ``model``'s own log-probs with the weights of version ``u``."""
    gen = samples.generation
    params = dict(model.named_parameters())
    gaps = {}
    for u in sorted(set(versions[versions >= 0].tolist())):
        with torch.no_grad():
            for n, value in weights[u].items():
                params[n].copy_(value)
            own, _ = completion_logps(model, samples.prompt_ids, samples.prompt_mask, gen.completion_ids,
                                      gen.completion_mask, temperature=1.0, compute_entropy=False)
        at = versions == u
        gaps[u] = float((own - behaviour).abs()[at].max())
    return gaps


def test_a_straddling_completion_has_each_versions_own_logps_token_by_token(tmp_path):
    """The producer's parts as the trainer builds them (its pipeline, scorer and sampler driver); new weights are
    published every three decoded tokens (a weight source that perturbs the sampler's copy): every token's behaviour
    log-prob is the log-prob of the version that sampled it, most completions straddle versions, and groups left in
    flight join later batches, each prompt once."""
    t = make(tmp_path / "out")
    sampler = copy.deepcopy(t.model).eval()
    weights = {0: trainable(sampler)}

    class EveryThreeTokens:
        def __init__(self):
            self.asked, self.due, self.version = 0, 3, 0

        def newer(self):
            self.asked += 1
            return self.asked >= self.due

        def refresh(self):
            if self.asked >= self.due:
                with torch.no_grad():
                    for p in sampler.parameters():
                        p.add_(0.05 * torch.randn_like(p))
                self.version += 1
                weights[self.version] = trainable(sampler)
                self.due = self.asked + 3
            return self.version

    source = EveryThreeTokens()
    driver = SamplerDriver(t.driver, sampler)
    rows_of = BatchRows(t.train_dataset, t.pipeline.order, 4, 16)
    batches, in_flight = [], []
    for k in range(4):
        stats = RolloutStats()
        batches.append(t.pipeline.partial.produce(k, rows_of, driver, source, 0, stats, ahead=(k + 1, 0)))
        in_flight.append(dict(stats.metrics)["sample/partial_in_flight"])
    model = copy.deepcopy(sampler)
    straddling = 0
    for b in batches:
        gaps = gaps_by_version(model, weights, b.samples, b.behaviour_logps, b.token_versions)
        assert max(gaps.values()) < 1e-4, gaps
        straddling += sum(len(set(v[v >= 0].tolist())) > 1 for v in b.token_versions)
    assert source.version >= 4 and straddling >= 8
    assert max(in_flight) > 0  # groups outlived their batch
    prompts = [p[0]["content"] for b in batches for p in b.samples.prompts[::4]]
    assert len(prompts) == 16 and len(set(prompts)) == 16  # each prompt's group once


@pytest.mark.parametrize("workers", [0, 1], ids=["thread", "worker"])
def test_through_the_trainer_behaviour_logps_are_each_versions_own(tmp_path, workers, monkeypatch):
    """Through GRPOTrainer: every batch's per-token behaviour log-probs equal the learner's own log-probs with its
    weights of the version that sampled each token; no token is older than max_staleness; every parameter moves."""
    taken = []
    next_batch = AsyncRollouts.next_batch

    def record(self, version, is_main_process):
        batch = next_batch(self, version, is_main_process)
        taken.append((version, batch))
        return batch

    monkeypatch.setattr(AsyncRollouts, "next_batch", record)
    t = make(tmp_path / "out", rollout_workers=workers)
    weights = {}

    class Keep(TrainerCallback):
        def on_train_begin(self, args, state, control, **k):
            weights[0] = trainable(t.model)

        def on_step_end(self, args, state, control, **k):
            weights[state.global_step] = trainable(t.model)

    t.add_callback(Keep())
    before = trainable(t.model)
    t.train()
    assert all(not torch.equal(before[n], p) for n, p in t.model.named_parameters()), "a parameter did not move"
    model = copy.deepcopy(t.model)
    for version, b in taken:
        assert b.token_versions is not None
        valid = b.token_versions[b.token_versions >= 0]
        assert int((version - valid).max()) <= 2
        gaps = gaps_by_version(model, weights, b.samples, b.behaviour_logps, b.token_versions)
        assert max(gaps.values()) < 1e-4, gaps
    logs = [h for h in t.state.log_history if "reward" in h]
    assert len(logs) == 6 and all(h["sample/token_staleness_max"] <= 2 for h in logs)


def test_a_resumed_run_loses_no_prompt_and_trains_none_twice(tmp_path):
    """Three steps, a checkpoint, then three more from it: across both runs no prompt is trained twice, and every
    prompt of the batches admitted so far was trained or is in flight in the last checkpoint's state."""
    trained = []

    def run(max_steps, resume):
        t = make(tmp_path / "out", max_steps=max_steps, save_strategy="steps", save_steps=3)
        finish = t.pipeline.finish

        def record(samples, stats, driver, mode="train", **kw):
            if mode == "train":
                trained.extend(p[0]["content"] for p in samples.prompts[::4])
            return finish(samples, stats, driver, mode, **kw)

        t.pipeline.finish = record
        t.train(resume_from_checkpoint=resume)
        return t

    run(3, None)
    t = run(6, True)
    assert len(trained) == 24 and len(set(trained)) == 24
    state = t.pipeline.state_dict()
    in_flight = {t.train_dataset[t.pipeline.order.batch(k)[j]]["prompt"][0]["content"]
                 for k, j in state["partial_in_flight"]}
    admitted = {t.train_dataset[i]["prompt"][0]["content"]
                for k in range(state["partial_admitted_through"] + 1) for i in t.pipeline.order.batch(k)}
    assert set(trained) | in_flight == admitted and not set(trained) & in_flight


@pytest.mark.parametrize("settings, words", [
    ({"max_staleness": 0}, "max_staleness=0 is not allowed with partial_rollouts=True: use 1 or more"),
    ({"dynamic_sampling": True}, "dynamic_sampling=True is not allowed with partial_rollouts=True"),
    ({"staleness_mode": "exact"}, "staleness_mode='exact' is not allowed with partial_rollouts=True"),
    ({"generation_kwargs": {"min_new_tokens": 2}}, "generation_kwargs={'min_new_tokens': 2} is not allowed"),
])
def test_what_partial_rollouts_do_not_continue_is_one_line(tmp_path, settings, words):
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        run_args(tmp_path, **{"partial_rollouts": True, "max_staleness": 2, **settings})
    assert "\n" not in str(e.value)


def test_tools_are_refused_at_train_start(tmp_path):
    def lookup(city: str) -> str:
        """Look a city up.

        Args:
            city: the city
        """
        return city

    from grpokit.tools import CHATML_TOOLS_TEMPLATE

    tok = tiny_tokenizer()
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    args = run_args(tmp_path, partial_rollouts=True, max_staleness=1, max_steps=1)
    t = GRPOTrainer(eos_model(tok), chars, args=args, train_dataset=dataset(), processing_class=tok, tools=[lookup])
    with pytest.raises(ValueError, match="partial_rollouts=True is not allowed here: tools and environments") as e:
        t.train()
    assert "\n" not in str(e.value)
