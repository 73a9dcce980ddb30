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
            assert saved["prompt_skipper"] == trainer.pipeline.prompts.skipper.state_dict()
            assert max(saved["prompt_skipper"]["streaks"].values()) >= 2
            resumed = GRPOTrainer(tiny_model(tok), spread_only_for_easy,
                                  args=make_args(tmp_path / str(p), max_steps=7, dynamic_sampling_explore_prob=p),
                                  train_dataset=_dataset(), processing_class=tok)
            resumed.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-6"))
            assert set(saved["prompt_skipper"]["streaks"]) <= set(resumed.pipeline.prompts.skipper.streaks)
            assert resumed.pipeline.prompts.skipper.draws >= saved["prompt_skipper"]["draws"] > 0  # loaded, not started afresh
        else:
            assert trainer.pipeline.prompts.skipper is None
            assert all("dynamic_sampling/skipped_frac" not in h for h in logs)
    # without skipping the refill stream generates hard prompts again and again; with it, about once each (16 of them)
    assert counts[0.05][0] <= 18 < counts[1.0][0] and counts[0.05][1] <= 2 < counts[1.0][1]


def test_explore_prob_is_checked():
    with pytest.raises(ValueError, match=r"dynamic_sampling_explore_prob=0 is not allowed"):
        GRPOConfig(output_dir="/tmp/ds", dynamic_sampling=True, dynamic_sampling_explore_prob=0)
    with pytest.raises(ValueError, match=r"dynamic_sampling_explore_prob=1.5 is not allowed"):
        GRPOConfig(output_dir="/tmp/ds", dynamic_sampling=True, dynamic_sampling_explore_prob=1.5)


def test_hard_groups_are_those_below_the_best_reward_seen():
    """A group that scored alike is hard when its reward is below the best any completion has had so far (none of
    its completions solved it), easy at it; a group nobody could score is hard; spread clears both."""
    s = PromptSkipper(0.5, seed=0, explore_prob_hard=1.0)
    rows = [row("solved")] * 2 + [row("failed")] * 2 + [row("mixed")] * 2 + [row("unscored")] * 2
    nan = float("nan")
    s.observe(prompts(rows), 2, [False, False, True, False], rewards=[1.2, 1.2, 0.2, 0.2, 0.2, 1.2, nan, nan])
    key = {name: prompt_key(row(name)["prompt"]) for name in ("solved", "failed", "mixed", "unscored")}
    assert s.best == 1.2 and s.hard == {key["failed"], key["unscored"]}
    assert s.streaks[key["solved"]] == s.streaks[key["failed"]] == 1 and s.streaks[key["mixed"]] == 0
    s.observe(prompts(rows[2:4]), 2, [True], rewards=[0.2, 1.2])
    assert key["failed"] not in s.hard
    # without rewards (a caller that does not say) every group counts as easy, as before
    s.observe(prompts(rows[:2]), 2, [False])
    assert key["solved"] not in s.hard and s.streaks[key["solved"]] == 2


def test_hard_prompts_take_their_own_explore_prob():
    s = PromptSkipper(0.01, seed=0, explore_prob_hard=1.0)
    s.observe(prompts([row("easy"), row("hard")] * 1), 1, [False, False], rewards=[1.0, 0.0])
    s.observe(prompts([row("easy"), row("hard")] * 1), 1, [False, False], rewards=[1.0, 0.0])
    assert all(s.keep(row("hard")) for _ in range(200)) and s.draws == 0  # p_hard = 1: never a draw
    assert sum(s.keep(row("easy")) for _ in range(200)) < 5  # 1 - 0.01**2 of them skipped
    t = PromptSkipper(0.9, seed=0, explore_prob_hard=0.01)  # and the other way round
    t.observe(prompts([row("easy"), row("hard")]), 1, [False, False], rewards=[1.0, 0.0])
    assert sum(t.keep(row("hard")) for _ in range(200)) < 10 < sum(t.keep(row("easy")) for _ in range(200))


def test_which_prompts_are_hard_is_checkpointed():
    a = PromptSkipper(0.5, seed=1, explore_prob_hard=1.0)
    a.observe(prompts([row("x"), row("y")]), 1, [False, False], rewards=[1.0, 0.0])
    b = PromptSkipper(0.5, seed=1, explore_prob_hard=1.0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.hard, b.best, b.streaks) == (a.hard, a.best, a.streaks) and b.hard
    c = PromptSkipper(0.5, seed=1)
    c.load_state_dict({"streaks": a.state_dict()["streaks"], "draws": 3})  # a checkpoint from before: all easy
    assert c.hard == set() and c.best is None and c.draws == 3


def solved_failed_or_spread(completions, hard, **kw):
    """'Hard' prompts (two in three) score 0 for every completion when their number is odd (failed) and 1 when even
    (solved: the best reward); the others score their distinct characters (spread, below 1)."""
    out = []
    for c, h, p in zip(completions, hard, kw["prompts"]):
        number = int(p[0]["content"][1:])
        out.append((1.0 if number % 2 == 0 else 0.0) if h else min(0.9, len(set(c[0]["content"])) / 16))
    return out


def _skip_decisions(trainer) -> dict[str, list[bool]]:
    """Per prompt, every keep/skip decision the trainer's GRESO filter makes."""
    decisions: dict[str, list[bool]] = {}
    skipper = trainer.pipeline.prompts.skipper
    keep = skipper.keep

    def recorded(row):
        kept = keep(row)
        decisions.setdefault(row["prompt"][0]["content"], []).append(kept)
        return kept

    skipper.keep = recorded
    return decisions


def test_trainer_skips_solved_prompts_but_keeps_asking_failed_ones(tmp_path):
    """``dynamic_sampling_explore_prob_hard: 1``: prompts every completion failed are never skipped, while prompts
    every completion solved are skipped with ``dynamic_sampling_explore_prob``; without it both are skipped alike."""
    tok = tiny_tokenizer()
    counts, skipped = {}, {}
    for hard_p in (None, 1.0):
        args = make_args(tmp_path / str(hard_p), max_steps=10, dynamic_sampling_explore_prob=0.05,
                         dynamic_sampling_explore_prob_hard=hard_p)
        trainer = GRPOTrainer(tiny_model(tok), solved_failed_or_spread, args=args, train_dataset=_dataset(),
                              processing_class=tok)
        seen, decisions = _generated_prompts(trainer), _skip_decisions(trainer)
        trainer.train()
        tied = [name for name in seen if int(name[1:]) % 3 != 0]
        failed = [name for name in tied if int(name[1:]) % 2 == 1]
        solved = [name for name in tied if int(name[1:]) % 2 == 0]
        counts[hard_p] = sum(seen[n] for n in failed), sum(seen[n] for n in solved)
        skipped[hard_p] = (sum(not k for n in failed for k in decisions.get(n, [])),
                           sum(not k for n in solved for k in decisions.get(n, [])))
    assert skipped[None][0] > 0 and skipped[None][1] > 0  # one probability: failed and solved prompts both skipped
    assert skipped[1.0][0] == 0 and skipped[1.0][1] > 0  # p_hard = 1: failed ones never, solved ones still
    (failed_alike, solved_alike), (failed_hard, solved_hard) = counts[None], counts[1.0]
    assert failed_hard >= failed_alike + 8  # so the 8 failed prompts are generated again and again (22 against 9)
    assert solved_hard <= 12 and solved_alike <= 12  # the 8 solved ones about once each either way
