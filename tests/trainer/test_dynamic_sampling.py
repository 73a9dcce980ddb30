"""DAPO dynamic sampling: groups whose rewards are all equal are replaced by fresh groups until the generation batch
is full, for at most dynamic_sampling_max_rounds extra rounds; the rest is filled with the dropped groups."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from tiny import tiny_model, tiny_tokenizer

from grpokit.config import GRPOConfig
from grpokit.pipeline import GroupFilter, PromptOrder, PromptStream, RolloutPipeline, first_round_groups
from grpokit.pipeline.samples import ScoredSamples
from grpokit.rollout.base import Generation
from grpokit.trainer import GRPOTrainer

G = 2


def fake_samples(group_rewards: list[list[float]], tag: str) -> ScoredSamples:
    rewards = [r for group in group_rewards for r in group]
    n = len(rewards)
    ids = torch.arange(n).unsqueeze(1).repeat(1, 3)
    gen = Generation(completion_ids=ids, completion_mask=torch.ones_like(ids), is_truncated=torch.zeros(n, dtype=bool))
    names = [f"{tag}{i // G}" for i in range(n)]
    return ScoredSamples(prompts=names, prompt_texts=names, prompt_ids=ids[:, :2], prompt_mask=torch.ones(n, 2),
                         generation=gen, completion_texts=names, completions=names, completion_id_lists=ids.tolist(),
                         rewards=torch.tensor(rewards).unsqueeze(1), n_truncated_prompts=0)


class FakeStream:
    """The refill stream of :class:`grpokit.pipeline.PromptStream`'s interface: rows that only say which draw they
    came from, no skipping."""

    def __init__(self):
        self.draws = []

    def skip(self, rows):
        return rows

    def draw(self, n_groups):
        self.draws.append(n_groups)
        return [{"draw": len(self.draws)}] * (n_groups * G)

    def observe(self, samples, spread):
        pass

    def record(self, stats):
        pass

    def state_dict(self):
        return {}


class OneProcess:
    lockstep = False

    def generation_batch(self):
        import contextlib

        return contextlib.nullcontext()


def fill(first, more, max_rounds=3, factor=1.0, need=None, last_keep_rate=None):
    """Dynamic sampling through :meth:`RolloutPipeline.sample`: the first round scores as ``first`` (the batch's
    ``need`` groups, default all of ``first``'s, and what the filter asks for beyond them), every later round of
    ``n`` refill groups as ``more(n)``. Returns the samples, the rounds' sizes and the metrics."""
    args = SimpleNamespace(num_generations=G, dynamic_sampling_max_rounds=max_rounds,
                           dynamic_sampling_oversample=factor)
    group_filter = GroupFilter(args, torch.ones(1), pad_id=0)
    group_filter.last_keep_rate = last_keep_rate
    stream, calls = FakeStream(), []

    class Scorer:
        bounds = None

        def __call__(self, rows, driver, stats):
            calls.append(len(rows) // G)
            return first if len(calls) == 1 else more(len(rows) // G)

    pipeline = RolloutPipeline(Scorer(), None, group_filter, prompts=stream)
    rows = [{"batch": True}] * (G * (need if need is not None else len(first) // G))
    samples, stats = pipeline.sample(rows, OneProcess())
    return samples, calls[1:], dict(stats.metrics)


def test_fills_the_batch_with_groups_that_have_spread():
    first = fake_samples([[1, 1], [0, 1], [0, 0], [1, 1]], "a")  # one of four groups has spread

    def more(n):
        if n == 4:
            return fake_samples([[0, 1], [1, 1], [1, 0], [0.5, 0.5]][:n], "b")
        return fake_samples([[2, 3]] * n, "c")

    out, asked, m = fill(first, more)
    assert out.prompts == ["a1", "a1", "b0", "b0", "b2", "b2", "c0", "c0"]
    assert asked == [4, 3]  # 3 missing at a keep rate of 1/4 → 12, capped at the batch's 4; then 1 at 3/8 → 3
    assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/unfilled_frac"] == 0
    assert m["dynamic_sampling/filtered_frac"] == 5 / 11  # 11 groups generated, 5 without spread


def test_a_larger_round_cap_asks_for_what_the_keep_rate_says_in_one_round():
    first = fake_samples([[1, 1], [0, 1], [0, 0], [1, 1]], "a")  # one of four groups has spread

    def more(n):
        return fake_samples(([[0, 1], [1, 1], [1, 1], [1, 1]] * 3)[:n], "b")

    out, asked, m = fill(first, more, factor=4)
    assert asked == [12]  # 3 missing at a keep rate of 1/4 → 12, within 4 × the batch's 4 groups
    assert out.prompts == ["a1", "a1", "b0", "b0", "b4", "b4", "b8", "b8"]
    assert m["dynamic_sampling/rounds"] == 2 and m["dynamic_sampling/unfilled_frac"] == 0
    assert m["dynamic_sampling/filtered_frac"] == 12 / 16
    out, asked, m = fill(first, more, factor=1.5)
    assert asked == [6, 4]  # 12 capped at ⌊1.5 × 4⌋ = 6 (two kept); then 1 missing at a keep rate of 3/10 → 4
    assert out.prompts == ["a1", "a1", "b0", "b0", "b4", "b4", "b0", "b0"] and m["dynamic_sampling/rounds"] == 3


def test_first_round_is_sized_by_the_last_keep_rate():
    assert first_round_groups(8, None, 4) == 8  # no batch seen yet: the batch alone
    assert first_round_groups(8, 0.25, 1) == 8  # rounds of at most one batch (the default): the batch alone
    assert first_round_groups(8, 0.25, 4) == 32  # a quarter kept last time: 8 / 0.25
    assert first_round_groups(8, 0.3, 4) == 27  # ⌈8 / 0.3⌉
    assert first_round_groups(8, 0.0, 4) == 32  # nothing kept: 10× (the floor on the rate), capped at 4 × 8
    assert first_round_groups(8, 1.0, 4) == 8
    assert first_round_groups(4, 0.25, 1.5) == 6  # ⌊1.5 × 4⌋


def test_a_first_round_larger_than_the_batch_fills_to_need():
    """The last batch kept half: a batch of 2 groups asks for 4 more in its first round (the stream's first draw)."""
    first = fake_samples([[1, 1], [0, 1], [0, 0], [1, 0], [2, 0], [1, 1]], "a")  # groups 1, 3 and 4 have spread
    out, asked, m = fill(first, None, need=2, factor=4, last_keep_rate=0.5)
    assert out.prompts == ["a1", "a1", "a3", "a3"]  # no extra round: the surplus group a4 is discarded
    assert asked == [] and m["dynamic_sampling/rounds"] == 1 and m["dynamic_sampling/filtered_frac"] == 0.5
    out, asked, m = fill(first, lambda n: fake_samples([[0, 1]] * n, "b"), need=4, factor=2, last_keep_rate=0.75)
    assert asked == [2]  # one missing at a keep rate of 3/6 → 2
    assert out.prompts == ["a1", "a1", "a3", "a3", "a4", "a4", "b0", "b0"] and m["dynamic_sampling/rounds"] == 2


def test_rounds_run_out_and_dropped_groups_fill_the_rest():
    first = fake_samples([[1, 1], [0, 0], [0, 1]], "a")
    out, asked, m = fill(first, lambda n: fake_samples([[5, 5]] * n, "b"), max_rounds=2)
    assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/unfilled_frac"] == 2 / 3
    assert out.prompts[:2] == ["a2", "a2"] and len(out) == 6  # the informative group first, then dropped ones


def test_whole_groups_are_required():
    with pytest.raises(ValueError, match="not a multiple of num_generations=2"):
        fill(fake_samples([[1, 0]], "a").select([0]), None, max_rounds=1, need=1)


def _dataset(n=24):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
                              "hard": [i % 3 != 0 for i in range(n)]})


def spread_only_for_easy(completions, hard, **kw):
    """Every completion of a 'hard' prompt scores 0 (no spread); others score their distinct characters."""
    return [0.0 if h else len(set(c[0]["content"])) / 8 for c, h in zip(completions, hard)]


def make_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                max_completion_length=8, max_steps=3, logging_steps=1, report_to="none", gradient_checkpointing=False,
                learning_rate=1e-2, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                dynamic_sampling=True, dynamic_sampling_max_rounds=8)
    base.update(kw)
    return GRPOConfig(**base)


def test_trainer_trains_only_on_groups_with_spread(tmp_path):
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), spread_only_for_easy, args=make_args(tmp_path), train_dataset=_dataset(),
                          processing_class=tok)
    batches = []
    finish = trainer.pipeline.finish

    def record(samples, stats, driver, mode="train", behaviour_logps=None):
        batches.append(samples)
        return finish(samples, stats, driver, mode, behaviour_logps)

    trainer.pipeline.finish = record
    trainer.train()
    for s in batches:
        assert len(s) == 8
        totals = s.rewards.sum(1).view(-1, 4)
        assert all(len(set(g.tolist())) > 1 for g in totals)  # every kept group has reward spread
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert all(h["frac_reward_zero_std"] == 0.0 and h["dynamic_sampling/unfilled_frac"] == 0.0 for h in logs)
    assert all(h["dynamic_sampling/rounds"] >= 1 and 0 <= h["dynamic_sampling/filtered_frac"] < 1 for h in logs)
    assert any(h["dynamic_sampling/filtered_frac"] > 0 for h in logs)  # 2 of 3 prompts are hard
    assert trainer.pipeline.prompts.refill_position > 0


def test_refill_position_is_checkpointed_and_restored(tmp_path):
    tok = tiny_tokenizer()
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first = GRPOTrainer(tiny_model(tok), spread_only_for_easy, args=args, train_dataset=_dataset(), processing_class=tok)
    first.train()
    saved = json.loads(open(os.path.join(args.output_dir, "checkpoint-2", "grpokit_state_0.json")).read())
    assert saved["refill_position"] == first.pipeline.prompts.refill_position > 0
    resumed = GRPOTrainer(tiny_model(tok), spread_only_for_easy, args=make_args(tmp_path, max_steps=3),
                          train_dataset=_dataset(), processing_class=tok)
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    assert resumed.pipeline.prompts.refill_position >= saved["refill_position"]


def test_first_round_of_later_batches_adds_what_the_keep_rate_says(tmp_path):
    """With rounds up to 4× the batch, a batch's first generation call already holds the refill prompts the last
    batch's keep rate asks for (one call instead of two); the rate is checkpointed with the refill position."""
    tok = tiny_tokenizer()
    args = make_args(tmp_path, max_steps=3, dynamic_sampling_oversample=4, save_strategy="steps", save_steps=3)
    calls, keep_rates = [], []

    def instrumented(trainer):
        group_filter, driver = trainer.pipeline.filter, trainer.driver
        generate, first_round = driver.generate, group_filter.first_round

        def sized(*a, **k):  # the keep rate the batch's first round is sized by
            keep_rates.append(group_filter.last_keep_rate)
            return first_round(*a, **k)

        def counted(prompts, max_new_tokens=None):
            calls.append(prompts.ids.shape[0])
            return generate(prompts, max_new_tokens)

        driver.generate, group_filter.first_round = counted, sized
        return trainer

    trainer = instrumented(GRPOTrainer(tiny_model(tok), spread_only_for_easy, args=args, train_dataset=_dataset(),
                                       processing_class=tok))
    trainer.train()
    assert keep_rates[0] is None and all(0 < r < 1 for r in keep_rates[1:])  # 2 of 3 prompts are hard
    rounds = [int(h["dynamic_sampling/rounds"]) for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    assert calls[0] == 8  # the first batch: its 2 prompts × 4
    first_calls = [calls[sum(rounds[:i])] for i in range(len(rounds))]
    assert first_calls[1:] == [4 * first_round_groups(2, r, 4) for r in keep_rates[1:]]
    assert all(n > 8 for n in first_calls[1:])
    saved = json.loads(open(os.path.join(args.output_dir, "checkpoint-3", "grpokit_state_0.json")).read())
    assert saved["last_keep_rate"] == trainer.pipeline.filter.last_keep_rate
    keep_rates.clear()
    resumed = instrumented(GRPOTrainer(tiny_model(tok), spread_only_for_easy, args=make_args(tmp_path, max_steps=4),
                                       train_dataset=_dataset(), processing_class=tok))
    resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-3"))
    assert keep_rates == [saved["last_keep_rate"]]  # the resumed batch is sized as the uninterrupted run's would be


@pytest.mark.parametrize("shuffle", [True, False])
def test_refill_stream_follows_shuffle_dataset(tmp_path, shuffle):
    """Unshuffled (a curriculum), the refill stream walks the dataset in order from the prompts after the sampler's
    first generation batch; shuffled, a seeded permutation of the whole dataset per pass."""
    tok = tiny_tokenizer()
    trainer = GRPOTrainer(tiny_model(tok), spread_only_for_easy, args=make_args(tmp_path, shuffle_dataset=shuffle),
                          train_dataset=_dataset(), processing_class=tok)
    rows = trainer.pipeline.prompts.draw(3) + trainer.pipeline.prompts.draw(23)
    names = [r["prompt"][0]["content"] for r in rows[::4]]
    assert all(rows[i] == rows[i - i % 4] for i in range(len(rows)))  # each prompt num_generations times
    if shuffle:
        assert sorted(names[:24]) == sorted(f"q{i}" for i in range(24)) and names[:24] != [f"q{i}" for i in range(24)]
    else:
        assert names == [f"q{(i + 2) % 24}" for i in range(26)]  # 2 prompts in a generation batch of 8 rows


def test_unshuffled_refill_stream_across_ranks(tmp_path):
    """Two processes: the first generation batch took global prompts 0-3 (16 rows / 4 generations); the ranks then
    take every other prompt from there, rank 1 from q5."""
    args = make_args(tmp_path, shuffle_dataset=False)
    rank1 = PromptStream(_dataset(), PromptOrder(24, 16 // 4, shuffle=False), args, torch.ones(1), rank=1,
                         world_size=2)
    assert [r["prompt"][0]["content"] for r in rank1.draw(3)[::4]] == ["q5", "q7", "q9"]


def test_lora_is_merged_once_per_generation_batch_and_given_back(tmp_path, monkeypatch):
    """Dynamic sampling's rounds generate with one merge of the adapter (not one per round) — or, where oneDNN
    computes bf16, one fold of it into packed weights and no merge — and the bf16 base weights come back exactly:
    training moves only the adapter."""
    from peft import LoraConfig
    from peft.tuners.lora.layer import Linear as LoraLinear

    from grpokit.rollout import packed

    merges, folds = [], []
    merge, fold = LoraLinear.merge, packed.folded_weight

    def counted(self, *a, **k):
        merges.append(self)
        return merge(self, *a, **k)

    def counted_fold(layer):
        folds.append(layer)
        return fold(layer)

    monkeypatch.setattr(LoraLinear, "merge", counted)
    monkeypatch.setattr(packed, "folded_weight", counted_fold)
    tok = tiny_tokenizer()
    model = tiny_model(tok).to(torch.bfloat16)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = GRPOTrainer(model, spread_only_for_easy, args=make_args(tmp_path, max_steps=2), train_dataset=_dataset(),
                          processing_class=tok, peft_config=LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    layers = sum(isinstance(m, LoraLinear) for m in trainer.model.modules())
    trainer.train()
    rounds = [h["dynamic_sampling/rounds"] for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    assert len(rounds) == 2 and sum(rounds) > 2  # some batch took more than one round...
    prepared, unused = (folds, merges) if torch.bfloat16 in packed.packable_dtypes() else (merges, folds)
    assert len(prepared) == 2 * layers and not unused  # ...and each batch merged (or folded) every LoRA layer once
    now = trainer.model.get_base_model().state_dict()
    for k, v in base.items():
        key = k if k in now else k.replace(".weight", ".base_layer.weight")
        assert torch.equal(now[key], v), k


def test_dynamic_sampling_config():
    with pytest.raises(ValueError, match=r"dynamic_sampling_max_rounds=0 is not allowed"):
        GRPOConfig(output_dir="/tmp/ds", dynamic_sampling=True, dynamic_sampling_max_rounds=0)
