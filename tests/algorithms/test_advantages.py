"""Family 7: advantages (docs/algorithms.md §7), hand-computed with ``statistics`` / plain arithmetic."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from grpokit.algorithms import compute_advantages, dynamic_sampling_keep, group_advantages, overlong_penalty

F64 = torch.float64
NAN = float("nan")
EPS = 1e-4


def col(values):
    return torch.tensor([[v] for v in values], dtype=F64)


def approx(values, rel=1e-12, abs_=1e-15):
    return pytest.approx(values, rel=rel, abs=abs_)


def test_group_scaling_by_hand():
    R = [1.0, 0.0, 0.25, 2.0, 3.0, 3.0, 3.0, 3.0]  # two groups of 4; the second is tied
    g1 = R[:4]
    mu, sd = statistics.mean(g1), statistics.stdev(g1)  # unbiased (n - 1)
    expected = [(r - mu) / (sd + EPS) for r in g1] + [0.0] * 4
    assert compute_advantages(col(R), 4).tolist() == approx(expected)
    assert compute_advantages(col(R), 4, scale_rewards=True).tolist() == approx(expected)


def test_batch_scaling_by_hand():
    R = [1.0, 0.0, 0.25, 2.0, 5.0, 3.0, 4.0, 3.5]
    sd = statistics.stdev(R)  # over the whole generation batch
    expected = []
    for g in (R[:4], R[4:]):
        mu = statistics.mean(g)  # the baseline is still the group mean
        expected += [(r - mu) / (sd + EPS) for r in g]
    assert compute_advantages(col(R), 4, scale_rewards="batch").tolist() == approx(expected)


def test_no_scaling_by_hand():
    R = [1.0, 0.0, 0.25, 2.0, 5.0, 3.0]
    expected = [1.0 - 0.5, 0.0 - 0.5, 0.25 - 1.125, 2.0 - 1.125, 1.0, -1.0]
    assert compute_advantages(col(R), 2, scale_rewards="none").tolist() == approx(expected)
    assert compute_advantages(col(R), 2, scale_rewards=False).tolist() == approx(expected)


def test_reward_weights_by_hand():
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, 0.0]], dtype=F64)
    w = [2.0, -0.5]
    R = [2.0, -0.5, 1.5, 1.0]
    mu, sd = statistics.mean(R), statistics.stdev(R)
    assert compute_advantages(r, 4, reward_weights=w).tolist() == approx([(x - mu) / (sd + EPS) for x in R])
    assert compute_advantages(r, 4, reward_weights=torch.tensor(w)).tolist() == approx(
        [(x - mu) / (sd + EPS) for x in R], rel=1e-6)
    res = group_advantages(r, 4, reward_weights=w)
    assert res.rewards.tolist() == approx(R)


def test_none_rewards_are_skipped():
    # row 1: function 0 returned None -> R = w1·r1 only; row 3: every function None -> unscorable, A = 0, and it
    # is left out of its group's mean and std.
    r = torch.tensor([[1.0, 1.0], [NAN, 0.5], [0.0, 0.0], [NAN, NAN]], dtype=F64)
    R_valid = [2.0, 0.5, 0.0]
    mu, sd = statistics.mean(R_valid), statistics.stdev(R_valid)
    expected = [(x - mu) / (sd + EPS) for x in R_valid] + [0.0]
    got = compute_advantages(r, 4)
    assert got.tolist() == approx(expected)
    res = group_advantages(r, 4)
    assert math.isnan(res.rewards[3].item())


def test_all_nan_rows_and_groups_give_zero():
    r = torch.tensor([[NAN], [NAN], [1.0], [NAN], [2.0], [0.0]], dtype=F64)
    got = compute_advantages(r, 2)
    # group 0: nothing scorable; group 1: a single scorable row (no spread); group 2: a normal pair
    assert got[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    sd = statistics.stdev([2.0, 0.0])
    assert got[4:].tolist() == approx([1.0 / (sd + EPS), -1.0 / (sd + EPS)])
    for scale in ("group", "batch", "none"):
        assert torch.isfinite(compute_advantages(r, 2, scale_rewards=scale)).all()
    assert compute_advantages(torch.full((4, 2), NAN, dtype=F64), 2).tolist() == [0.0] * 4


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tied_groups_are_exactly_zero_even_with_rounding(scale, dtype):
    a, b = 0.1 + 0.2, 0.3  # differ in the last bit in float64
    assert a != b
    r = torch.tensor([[a], [b], [b], [a], [1.0], [0.0], [0.2], [0.7]], dtype=dtype)
    got = compute_advantages(r, 4, scale_rewards=scale)
    assert got[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert (got[4:] != 0).all()
    # the same through two reward functions whose sums differ only by rounding
    r2 = torch.tensor([[0.1, 0.2], [0.3, 0.0], [0.2, 0.1], [0.0, 0.3]], dtype=dtype)
    assert compute_advantages(r2, 4, scale_rewards=scale).tolist() == [0.0] * 4
    res = group_advantages(r, 4, scale_rewards=scale)
    assert res.zero_std.tolist() == [True] * 4 + [False] * 4  # frac_reward_zero_std = 0.5


def test_integer_and_float32_rewards():
    r = torch.tensor([[1], [0], [1], [1]])
    got = compute_advantages(r, 2)
    sd = statistics.stdev([1.0, 0.0])
    assert got.tolist() == pytest.approx([0.5 / (sd + EPS), -0.5 / (sd + EPS), 0.0, 0.0], rel=1e-6)


def test_rloo_by_hand():
    R = [1.0, 0.0, 0.5, 2.0, 4.0, 4.0]
    G = 3
    expected = []
    for k in range(0, len(R), G):
        g = R[k:k + G]
        expected += [g[i] - statistics.mean(g[:i] + g[i + 1:]) for i in range(G)]
    got = compute_advantages(col(R), G, advantage_estimator="rloo")
    assert got[:3].tolist() == approx(expected[:3])
    # group 2: [2, 4, 4] -> [2 - 4, 4 - 3, 4 - 3]
    assert got[3:].tolist() == approx([-2.0, 1.0, 1.0])
    # rloo is unscaled whatever scale_rewards says
    assert compute_advantages(col(R), G, advantage_estimator="rloo", scale_rewards="group").tolist() == approx(
        got.tolist())
    # rloo = G/(G-1) · (R - group mean)
    assert got[:3].tolist() == approx([(G / (G - 1)) * (r - 0.5) for r in R[:3]])


def test_rloo_group_of_one_and_nan_and_ties():
    assert compute_advantages(col([1.0, 5.0, -2.0]), 1, advantage_estimator="rloo").tolist() == [0.0, 0.0, 0.0]
    # NaN rows are left out of the leave-one-out mean and get 0
    got = compute_advantages(col([1.0, NAN, 3.0, 2.0]), 4, advantage_estimator="rloo")
    assert got.tolist() == approx([1.0 - 2.5, 0.0, 3.0 - 1.5, 2.0 - 2.0])
    # a group with a single valid row gets 0; a tied group gets exactly 0
    assert compute_advantages(col([NAN, 2.0, 0.1 + 0.2, 0.3]), 2, advantage_estimator="rloo").tolist() == [0.0] * 4


def test_reinforce_plus_plus_by_hand():
    """The batch's mean and spread, groups ignored: a tied group is not zeroed (it is below or above the batch)."""
    R = [1.0, 1.0, 1.0, 1.0, 1.2, 0.0, 0.2, 1.0, 0.0, 0.0, 0.0, 0.0]
    mu, sd = statistics.mean(R), statistics.stdev(R)
    got = compute_advantages(col(R), 4, advantage_estimator="reinforce_plus_plus", scale_rewards="batch")
    assert got.tolist() == approx([(r - mu) / (sd + EPS) for r in R])
    assert got[:4].min() > 0 and got[8:].max() < 0  # the all-right group pulled up, the all-wrong one pushed down
    # "group" scales by the batch's spread as well (there are no groups); "none" only centres
    assert compute_advantages(col(R), 4, advantage_estimator="reinforce_plus_plus").tolist() == approx(got.tolist())
    assert compute_advantages(col(R), 4, advantage_estimator="reinforce_plus_plus", scale_rewards="none").tolist() \
        == approx([r - mu for r in R])
    # the grouping does not matter; NaN rows are left out of the statistics and get 0
    assert compute_advantages(col(R), 2, advantage_estimator="reinforce_plus_plus").tolist() == approx(got.tolist())
    got = compute_advantages(col([1.0, NAN, 3.0, 2.0]), 2, advantage_estimator="reinforce_plus_plus",
                             scale_rewards="none")
    assert got.tolist() == approx([-1.0, 0.0, 1.0, 0.0])
    # a batch that scored all alike teaches nothing
    assert compute_advantages(col([0.5] * 4), 2, advantage_estimator="reinforce_plus_plus").tolist() == [0.0] * 4


def test_normalize_then_sum_by_hand():
    r = torch.tensor([[1.0, 10.0], [0.0, 30.0], [1.0, 20.0], [0.5, 20.0]], dtype=F64)
    w = [1.0, 0.5]
    G = 2
    per_row = [[0.0, 0.0] for _ in range(4)]
    for k in range(2):
        for start in (0, 2):
            g = [r[start, k].item(), r[start + 1, k].item()]
            mu, sd = statistics.mean(g), statistics.stdev(g)
            for j in range(2):
                per_row[start + j][k] = (g[j] - mu) / (sd + EPS)
    total = [w[0] * a + w[1] * b for a, b in per_row]
    mu, sd = statistics.mean(total), statistics.stdev(total)
    expected = [(t - mu) / (sd + EPS) for t in total]
    got = compute_advantages(r, G, reward_weights=w, multi_objective_aggregation="normalize_then_sum")
    assert got.tolist() == approx(expected, rel=1e-10)
    # scale_rewards is ignored
    for scale in ("batch", "none"):
        assert compute_advantages(r, G, reward_weights=w, multi_objective_aggregation="normalize_then_sum",
                                  scale_rewards=scale).tolist() == approx(expected, rel=1e-10)


def test_the_logged_reward_is_the_weighted_raw_reward_under_both_aggregations():
    # constant rewards 1 and 0 weighted 0.7 / 0.3: the completions are worth 0.7 whichever way advantages are made;
    # normalize_then_sum's own R is a sum of group-normalised values (0 here) and is not what is logged
    r = torch.tensor([[1.0, 0.0]] * 4 + [[1.0, float("nan")], [float("nan"), float("nan")], [1.0, 0.0], [1.0, 0.0]], dtype=F64)
    for agg in ("sum_then_normalize", "normalize_then_sum"):
        res = group_advantages(r, 4, reward_weights=[0.7, 0.3], multi_objective_aggregation=agg)
        assert res.weighted[:5].tolist() == approx([0.7] * 5) and math.isnan(res.weighted[5].item())
        assert res.weighted[6:].tolist() == approx([0.7, 0.7])
    res = group_advantages(r, 4, reward_weights=[0.7, 0.3], multi_objective_aggregation="normalize_then_sum")
    assert res.rewards[:4].tolist() == approx([0.0] * 4)


def test_normalize_then_sum_differs_from_sum_then_normalize_on_different_scales():
    # GDPO's point: a reward on a large scale does not swamp a small one
    r = torch.tensor([[1.0, 100.0], [0.0, 0.0], [0.0, 100.0], [1.0, 0.0]], dtype=F64)
    a = compute_advantages(r, 4, multi_objective_aggregation="normalize_then_sum")
    b = compute_advantages(r, 4)
    assert not torch.allclose(a, b)
    assert a[0] > a[1] and a[0] > a[2]  # row 0 wins both rewards


def test_dynamic_sampling_keep():
    R = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.1 + 0.2, 0.3, NAN, 2.0, NAN, NAN], dtype=F64)
    # groups of 2: spread / tied / tied-by-rounding / one valid row / nothing valid
    assert dynamic_sampling_keep(R, 2).tolist() == [True, False, False, False, False]
    two = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=F64)  # sums 1,1 | 1,0
    assert dynamic_sampling_keep(two, 2).tolist() == [False, True]


def test_overlong_penalty_by_hand():
    L, buf = 20, 5
    lengths = torch.tensor([0, 10, 15, 16, 18, 20, 25])
    # 0 up to L - buffer = 15; then -(len - 15)/5 · factor; -factor at and beyond L
    expected = [0.0, 0.0, 0.0, -0.2, -0.6, -1.0, -1.0]
    assert overlong_penalty(lengths, L, buf).tolist() == pytest.approx(expected, abs=1e-7)
    assert overlong_penalty(lengths, L, buf, overlong_penalty_factor=0.5).tolist() == pytest.approx(
        [0.5 * e for e in expected], abs=1e-7)


def test_dynamic_sampling_keep_uses_the_reward_weights():
    two = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=F64)
    # weights (1, 2): totals 1, 2 (spread) | 1, 0 (spread); weights (1, 1): 1, 1 (tied) | 1, 0
    assert dynamic_sampling_keep(two, 2, reward_weights=[1.0, 2.0]).tolist() == [True, True]
    assert dynamic_sampling_keep(two, 2, reward_weights=[1.0, 1.0]).tolist() == [False, True]


def test_total_reward_weights_the_functions_and_skips_what_they_skipped():
    from grpokit.algorithms.advantages import total_reward

    r = torch.tensor([[1.0, 0.5], [NAN, 0.5], [NAN, NAN]], dtype=F64)
    assert total_reward(r, [2.0, 1.0]).tolist()[:2] == [2.5, 0.5] and torch.isnan(total_reward(r)[2])
    assert total_reward(r).tolist()[:2] == [1.5, 0.5]
    flat = torch.tensor([0.3, NAN], dtype=F64)
    assert total_reward(flat) is flat  # already one total per row


def test_below_best_marks_groups_none_of_whose_completions_reached_the_best_reward():
    from grpokit.algorithms.advantages import below_best

    assert below_best([0.2, 0.2], 1.2) and not below_best([1.2, 1.2], 1.2)
    assert not below_best([1.2 - 1e-9, 0.2], 1.2)  # within the tolerance: at the best
    assert below_best([NAN, NAN], 1.2) and below_best([0.0], None)  # nothing scored, or nothing scored yet
    assert not below_best([NAN, 1.0], 1.0)  # NaN rows skipped


def test_estimators_come_from_a_registry_and_one_registered_later_is_a_choice():
    from grpokit.algorithms import (
        ADVANTAGE_ESTIMATORS,
        AdvantageEstimator,
        get_advantage_estimator,
        register_advantage_estimator,
    )
    from grpokit.algorithms.advantage_estimators import ADVANTAGE_ESTIMATOR_REGISTRY
    from grpokit.config import GRPOConfig

    assert tuple(ADVANTAGE_ESTIMATORS) == ("grpo", "rloo", "reinforce_plus_plus")
    with pytest.raises(ValueError, match="advantage_estimator='median' is not supported; allowed: grpo, rloo"):
        get_advantage_estimator("median")
    spec = AdvantageEstimator("median_baseline", "R - median of the group", "a test",
                              lambda total, g, scale: (total.view(-1, g) - total.view(-1, g).median(1, True).values)
                              .view(-1))
    register_advantage_estimator(spec)
    try:
        assert "median_baseline" in ADVANTAGE_ESTIMATORS
        GRPOConfig(output_dir="/tmp/adv", advantage_estimator="median_baseline")  # a valid choice now
        R = [1.0, 2.0, 6.0, 0.0, 0.0, 0.0]  # the second group is tied: 0 (ties_teach is False)
        assert compute_advantages(col(R), 3, advantage_estimator="median_baseline").tolist() == [-1.0, 0.0, 4.0, 0, 0, 0]
        with pytest.raises(ValueError, match="an advantage estimator named 'rloo' is already registered"):
            register_advantage_estimator(AdvantageEstimator("rloo", "", "", spec.advantages))
    finally:
        del ADVANTAGE_ESTIMATOR_REGISTRY["median_baseline"]
