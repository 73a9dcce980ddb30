"""GRESO's pre-rollout filter with dynamic sampling (``dynamic_sampling_explore_prob``): a prompt whose last z groups
all scored alike is generated again with probability p**z; the batch still fills with groups that have spread."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from test_dynamic_sampling import _dataset, make_args, spread_only_for_easy
from tiny import tiny_model, tiny_tokenizer

from grpokit.algorithms.advantages import skip_probability
from grpokit.config import GRPOConfig
from grpokit.pipeline import PromptSkipper, prompt_key
from grpokit.trainer import GRPOTrainer


def row(name: str) -> dict:
    return {"prompt": [{"role": "user", "content": name}]}


def prompts(rows: list[dict]) -> list:
    return [r["prompt"] for r in rows]


def test_skip_probability_is_one_minus_p_to_the_streak():
    assert skip_probability(0, 0.5) == 0.0
    assert skip_probability(1, 0.5) == 0.5
    assert skip_probability(3, 0.5) == 0.875
    assert skip_probability(4, 1.0) == 0.0  # p = 1: nothing is ever skipped


def test_streaks_grow_with_groups_that_scored_alike_and_reset_with_spread():
    s = PromptSkipper(0.5, seed=0)
    rows = [row("a")] * 2 + [row("b")] * 2
    s.observe(prompts(rows), 2, [False, True])
    s.observe(prompts(rows), 2, [False, False])
    assert s.streaks == {prompt_key(row("a")["prompt"]): 2, prompt_key(row("b")["prompt"]): 1}
    s.observe(prompts(rows), 2, [True, False])
    assert s.streaks == {prompt_key(row("a")["prompt"]): 0, prompt_key(row("b")["prompt"]): 2}


def test_a_prompt_off_streak_is_always_kept_without_a_draw():
    s = PromptSkipper(0.01, seed=0)
    s.observe(prompts([row("a")]), 1, [True])
    assert all(s.keep(row("a")) for _ in range(100)) and all(s.keep(row("new")) for _ in range(100))
    assert s.draws == 0 and s.take_skipped_frac() == 0.0


@pytest.mark.parametrize("streak, expected", [(1, 0.5), (3, 0.875)])
def test_skipped_share_follows_the_streak(streak, expected):
    s = PromptSkipper(0.5, seed=3)
    s.observe(prompts([row("a")] * streak), 1, [False] * streak)
    kept = sum(s.keep(row("a")) for _ in range(4000))
    assert abs((4000 - kept) / 4000 - expected) < 0.03  # binomial sd ≤ 0.008: seeded, so this never flakes
    assert s.take_skipped_frac() == (4000 - kept) / 4000 and s.take_skipped_frac() is None  # the counts reset


def test_draws_are_seeded_and_resume_from_the_saved_state():
    a = PromptSkipper(0.5, seed=7)
    a.observe(prompts([row("x"), row("y")]), 1, [False, False])
    first = [a.keep(row("x")) for _ in range(20)]
    b = PromptSkipper(0.5, seed=7)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.keep(row("y")) for _ in range(50)] == [b.keep(row("y")) for _ in range(50)]
    c = PromptSkipper(0.5, seed=7)
    c.observe(prompts([row("x"), row("y")]), 1, [False, False])
    assert [c.keep(row("x")) for _ in range(20)] == first
    d = PromptSkipper(0.5, seed=8)  # another seed, other draws
    d.observe(prompts([row("x")]), 1, [False])
    assert [d.keep(row("x")) for _ in range(20)] != first


def _generated_prompts(trainer) -> Counter:
    seen = Counter()
    score = trainer.pipeline.scorer

    def counted(rows, driver, stats):
        seen.update(r["prompt"][0]["content"] for r in rows[::trainer.args.num_generations])
        return score(rows, driver, stats)

    trainer.pipeline.scorer = counted
    return seen


def test_trainer_skips_prompts_that_keep_scoring_alike(tmp_path):
    """Two prompts in three always score all alike ('hard'). With p = 0.05 they are generated far less often than
    without skipping, every batch still holds only groups with spread, and the streaks are checkpointed."""
    tok = tiny_tokenizer()
    counts = {}
    for p in (1.0, 0.05):
        args = make_args(tmp_path / str(p), max_steps=6, dynamic_sampling_explore_prob=p, save_strategy="steps",
                         save_steps=6)
        trainer = GRPOTrainer(tiny_model(tok), spread_only_for_easy, args=args, train_dataset=_dataset(),
                              processing_class=tok)
        seen = _generated_prompts(trainer)
        trainer.train()
        hard = sum(n for name, n in seen.items() if int(name[1:]) % 3 != 0)
        counts[p] = hard, max(n for name, n in seen.items() if int(name[1:]) % 3 != 0)
        logs = [h for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
        assert all(h["dynamic_sampling/unfilled_frac"] == 0.0 and h["frac_reward_zero_std"] == 0.0 for h in logs)
        if p < 1:
            assert any(h["dynamic_sampling/skipped_frac"] > 0 for h in logs)
            saved = json.loads(open(os.path.join(args.output_dir, "checkpoint-6", "grpokit_state_0.json")).read())
            assert saved["prompt_skipper"] == trainer.pipeline.filter.skipper.state_dict()
            assert max(saved["prompt_skipper"]["streaks"].values()) >= 2
            resumed = GRPOTrainer(tiny_model(tok), spread_only_for_easy,
                                  args=make_args(tmp_path / str(p), max_steps=7, dynamic_sampling_explore_prob=p),
                                  train_dataset=_dataset(), processing_class=tok)
            resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-6"))
            assert set(saved["prompt_skipper"]["streaks"]) <= set(resumed.pipeline.filter.skipper.streaks)
            assert resumed.pipeline.filter.skipper.draws >= saved["prompt_skipper"]["draws"] > 0  # loaded, not started afresh
        else:
            assert trainer.pipeline.filter.skipper is None
            assert all("dynamic_sampling/skipped_frac" not in h for h in logs)
    # without skipping the refill stream generates hard prompts again and again; with it, about once each (16 of them)
    assert counts[0.05][0] <= 18 < counts[1.0][0] and counts[0.05][1] <= 2 < counts[1.0][1]


def test_explore_prob_is_checked():
    with pytest.raises(ValueError, match=r"dynamic_sampling_explore_prob=0 is not allowed"):
        GRPOConfig(output_dir="/tmp/ds", dynamic_sampling=True, dynamic_sampling_explore_prob=0)
    with pytest.raises(ValueError, match=r"dynamic_sampling_explore_prob=1.5 is not allowed"):
        GRPOConfig(output_dir="/tmp/ds", dynamic_sampling=True, dynamic_sampling_explore_prob=1.5)
