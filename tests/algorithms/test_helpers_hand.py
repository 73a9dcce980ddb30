"""Family 1 (continued): the public helpers of docs/algorithms.md §4–§6 on their own, by hand: the sampler/trainer
mismatch ratio (§5), k3 KL (§4), the off-policy and high-entropy masks (§6), aggregation (§3)."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import (
    aggregate_loss,
    high_entropy_mask,
    k3_kl,
    log_importance_weights,
    off_policy_sequence_mask,
    sampler_importance_ratio,
    token_log_ratio,
)

F64 = torch.float64
NAN = float("nan")


def t(x):
    return torch.tensor(x, dtype=F64)


def close(actual: torch.Tensor, expected, rel: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=rel, atol=1e-14)


OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]]
SAMPLER = [[-1.5, -1.0, -0.5], [-1.0, -0.2, NAN]]  # the last token could not be scored by the engine
MASK = [[1, 1, 1], [1, 1, 0]]
# δ = (old - sampler)·m = [[0.5, -1.0, 0], [-0.5, 0, 0]]


def test_token_modes_by_hand():
    rho = [[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(-0.5), 1.0, 1.0]]
    got = sampler_importance_ratio(t(OLD), t(SAMPLER), t(MASK), mode="token_truncate", clip_min=None, clip_max=None)
    close(got, rho)
    got = sampler_importance_ratio(t(OLD), t(SAMPLER), t(MASK), mode="token_truncate", clip_min=0.5, clip_max=1.5)
    close(got, [[1.5, 0.5, 1.0], [math.exp(-0.5), 1.0, 1.0]])
    got = sampler_importance_ratio(t(OLD), t(SAMPLER), t(MASK), mode="token_mask", clip_min=0.5, clip_max=1.5)
    close(got, [[0.0, 0.0, 1.0], [math.exp(-0.5), 1.0, 1.0]])
    assert got.shape == (2, 3) and not got.requires_grad


def test_sequence_modes_by_hand():
    # product ratio: exp(Σ_t δ) = exp(-0.5), exp(-0.5)
    got = sampler_importance_ratio(t(OLD), t(SAMPLER), t(MASK), mode="sequence_truncate", clip_max=None)
    assert got.shape == (2, 1)
    assert got.squeeze(-1).tolist() == pytest.approx([math.exp(-0.5)] * 2, rel=1e-14)
    got = sampler_importance_ratio(t(OLD), t(SAMPLER), t(MASK), mode="sequence_mask", clip_min=0.7)
    assert got.squeeze(-1).tolist() == [0.0, 0.0]  # e^{-0.5} = 0.61 < 0.7
    got = sampler_importance_ratio(t(OLD), t(SAMPLER), t(MASK), mode="sequence_truncate", clip_min=0.7)
    assert got.squeeze(-1).tolist() == pytest.approx([0.7, 0.7])


def test_defaults_are_sequence_mask_with_clip_max_three():
    old = t([[0.0, 0.0]])
    sampler = t([[-0.6, -0.6]])  # Σδ = 1.2: ρ = 3.32 > 3 -> masked to 0
    assert sampler_importance_ratio(old, sampler, torch.ones(1, 2, dtype=F64)).tolist() == [[0.0]]
    sampler = t([[-0.5, -0.5]])  # ρ = e = 2.72 ≤ 3: kept as is
    close(sampler_importance_ratio(old, sampler, torch.ones(1, 2, dtype=F64)), [[math.e]])


def test_identical_sampler_gives_ratio_one():
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        got = sampler_importance_ratio(t(OLD), t(OLD), t(MASK), mode=mode)
        assert (got == 1.0).all(), mode


def test_k3_kl_by_hand():
    lp, ref = t([[-1.0, -2.0, -0.5]]), t([[-1.5, -1.0, -0.5]])
    x = [-0.5, 1.0, 0.0]
    expected = [math.exp(v) - v - 1 for v in x]
    close(k3_kl(lp, ref), [expected])
    d = t([[0.3, -0.2, 0.1]])
    close(k3_kl(lp, ref, d), [[e * math.exp(dd) for e, dd in zip(expected, [0.3, -0.2, 0.1])]])
    assert (k3_kl(-torch.rand(4, 5, dtype=F64), -torch.rand(4, 5, dtype=F64)) >= 0).all()
    # clamped to ±20 before exp: finite for any gap
    assert torch.isfinite(k3_kl(t([[-1e4, 0.0]]), t([[0.0, -1e4]]))).all()


def test_token_log_ratio_and_levels_by_hand():
    lp = t([[-1.0, -2.0, -0.5]])
    old = t([[-1.2, -1.5, -30.0]])
    d = token_log_ratio(lp, old)
    close(d, [[0.2, -0.5, 20.0]])  # 29.5 clamps to 20
    m = t([[1, 1, 0]])
    assert log_importance_weights(d, m, "token") is d
    seq = log_importance_weights(d, m, "sequence")
    assert seq.shape == (1, 1) and seq.item() == pytest.approx(-0.15)
    st = log_importance_weights(d, m, "sequence_token")
    assert st.shape == (1, 3)
    close(st, [[-0.15] * 3])
    assert log_importance_weights(d, t([[0, 0, 0]]), "sequence").item() == 0.0  # empty row: 0, not NaN
    on = token_log_ratio(lp.clone().requires_grad_(True), None)
    assert (on == 0).all() and on.requires_grad


def test_off_policy_sequence_mask_by_hand():
    lp = t([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    sampler = t([[-0.8, -1.0], [-0.5, NAN], [0.0, 0.0], [-3.0, -3.0]])  # drift: 0.1, 0.25 (NaN counts 0), 1, -2
    A = t([-1.0, -1.0, 0.0, -5.0])
    got = off_policy_sequence_mask(A, lp, sampler, torch.ones(4, 2, dtype=F64), 0.2)
    assert got.tolist() == [[1.0], [0.0], [1.0], [1.0]]  # A = 0 counts as non-negative: kept
    got = off_policy_sequence_mask(A.unsqueeze(-1), lp, sampler, torch.ones(4, 2, dtype=F64), 0.25)
    assert got.tolist() == [[1.0], [1.0], [1.0], [1.0]]  # ≤ δ keeps


def test_high_entropy_mask_top_fraction():
    e = t([[float(i) for i in range(10)]])
    for q, kept in [(0.1, 1), (0.2, 2), (0.5, 5), (1.0, 10)]:
        assert high_entropy_mask(e, torch.ones_like(e), q).sum().item() == kept, q


def test_high_entropy_mask_threshold_over_every_rank():
    """With ``gather`` (data parallelism) the quantile is over every rank's valid entropies."""
    e = t([[0.1, 0.5], [0.9, 0.3]])
    m = torch.ones_like(e)
    # this rank alone: the 0.5-quantile of [0.1, 0.3, 0.5, 0.9] is 0.3 + 0.5·0.2 = 0.4 -> keep 0.5 and 0.9
    assert high_entropy_mask(e, m, 0.5).tolist() == [[0, 1], [1, 0]]
    other_rank = torch.tensor([2.0, 3.0, 4.0, 5.0])
    calls = []

    def gather(values):
        calls.append(values.clone())
        return torch.cat([values, other_rank])

    # all 8: pos 0.5·7 = 3.5 -> 0.9 + 0.5·(2.0 - 0.9) = 1.45: nothing on this rank reaches it
    assert high_entropy_mask(e, m, 0.5, gather).tolist() == [[0, 0], [0, 0]]
    # top 0.75: pos 0.25·7 = 1.75 -> 0.3 + 0.75·0.2 = 0.45 -> keep 0.5 and 0.9 here
    assert high_entropy_mask(e, m, 0.75, gather).tolist() == [[0, 1], [1, 0]]
    # a rank with no valid token still takes part in the gather (it is a collective) and keeps nothing
    assert high_entropy_mask(e, torch.zeros_like(e), 0.5, gather).sum() == 0
    assert [c.numel() for c in calls] == [4, 4, 0]


def test_aggregate_loss_by_hand():
    ell = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = t([[1, 1, 0], [1, 1, 1]])
    assert aggregate_loss(ell, m, "sequence_mean").item() == pytest.approx((1.5 + 5.0) / 2)
    assert aggregate_loss(ell, m, "sequence_mean", gradient_accumulation_steps=2).item() == pytest.approx(6.5 / 4)
    assert aggregate_loss(ell, m, "token_mean").item() == pytest.approx(18 / 5)
    assert aggregate_loss(ell, m, "fixed_length", max_completion_length=10).item() == pytest.approx(18 / 20)
    assert aggregate_loss(ell, m, "fixed_length").item() == pytest.approx(18 / 6)  # L defaults to T
    assert aggregate_loss(ell, m, "global_token_mean").item() == pytest.approx(18 / 5)
    assert aggregate_loss(ell, m, "global_token_mean", num_items_in_batch=30, num_processes=3,
                          gradient_accumulation_steps=4, steps_per_generation=2).item() == pytest.approx(18 / (30 / 3 * 4 / 2))
    assert aggregate_loss(ell, m, "sequence_sum").item() == pytest.approx(18 / 2)
    # one value per row (B, 1) broadcast over the valid tokens
    row = t([[2.0], [-1.0]])
    assert aggregate_loss(row, m, "sequence_mean").item() == pytest.approx(0.5)
    assert aggregate_loss(row, m, "sequence_sum").item() == pytest.approx((4.0 - 3.0) / 2)
    assert aggregate_loss(row, m, "global_token_mean").item() == pytest.approx((4.0 - 3.0) / 5)
    # empty micro-batch and all-masked rows give 0, never NaN
    for lt in ("sequence_mean", "token_mean", "fixed_length", "global_token_mean", "sequence_sum"):
        assert aggregate_loss(torch.zeros(0, 3, dtype=F64), torch.zeros(0, 3, dtype=F64), lt).item() == 0.0, lt
        assert aggregate_loss(ell, torch.zeros(2, 3, dtype=F64), lt).item() == 0.0, lt
