"""Clip-Cov: hand-computed values and gradients, the eligibility rules, the sampling of switched-off tokens, and its
configuration fields (derived from the loss's own description)."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import LossSettings, policy_loss
from grpokit.algorithms.losses.clip_cov import ClipCovParams, token_covariance

F64 = torch.float64


def flat(rows):
    return [v for row in rows for v in row]

LP = [[-1.0, -3.0], [-2.0, -2.0]]  # mean -2; with A = [1, -1] (mean 0) the covariances are [[1, -1], [0, 0]]
A = [1.0, -1.0]


def _run(lp, old, A, m, seed=0, **kw):
    x = torch.tensor(lp, dtype=F64, requires_grad=True)
    old_t = None if old is None else torch.tensor(old, dtype=F64)
    out = policy_loss(x, old_t, torch.tensor(A, dtype=F64), torch.tensor(m, dtype=F64), loss_type="clip_cov",
                      generator=torch.Generator().manual_seed(seed), **kw)
    out.loss.backward()
    return out.loss.item(), x.grad.tolist(), {k: v.item() for k, v in out.metrics.items()}


def test_token_covariance_by_hand():
    cov = token_covariance(torch.tensor(LP, dtype=F64), torch.tensor(A, dtype=F64).unsqueeze(-1),
                           torch.ones(2, 2, dtype=F64))
    assert cov.tolist() == [[1.0, -1.0], [0.0, 0.0]]


def test_the_one_eligible_token_is_switched_off_on_policy():
    # lb 0.5 < cov < ub 5: only token (0, 0); ⌊ratio·4⌋ rounds up to 1 token. On-policy r = 1, ℓ = -A elsewhere,
    # aggregated over the 4 tokens (global token mean): (0 - 1 + 1 + 1) / 4.
    loss, grad, metrics = _run(LP, None, A, [[1, 1], [1, 1]], clip_cov_lb=0.5)
    assert loss == pytest.approx(0.25, abs=1e-15)
    assert flat(grad) == pytest.approx(flat([[0.0, -0.25], [0.25, 0.25]]), abs=1e-15)
    assert metrics["clip_cov/clipped_frac"] == 0.25
    assert metrics["clip_ratio/region_mean"] == 0.0


def test_tokens_ppo_already_clipped_are_not_eligible():
    # token (0, 0) has r = e^0.5 > 1.2 with A > 0: PPO clips it (no gradient), so Clip-Cov picks nothing else
    old = [[-1.5, -3.0], [-2.0, -2.0]]
    loss, grad, metrics = _run(LP, old, A, [[1, 1], [1, 1]], clip_cov_lb=0.5)
    assert metrics["clip_cov/clipped_frac"] == 0.0
    assert metrics["clip_ratio/high_mean"] == 0.25
    assert loss == pytest.approx((-1.2 - 1.0 + 1.0 + 1.0) / 4, abs=1e-15)
    assert flat(grad) == pytest.approx(flat([[0.0, -0.25], [0.25, 0.25]]), abs=1e-15)


def test_default_bounds_leave_small_covariances_alone():
    # the default window (1, 5) is open: a covariance of exactly 1 is not eligible, so this is plain PPO (dapo)
    loss, grad, metrics = _run(LP, None, A, [[1, 1], [1, 1]])
    dapo = policy_loss(torch.tensor(LP, dtype=F64), None, torch.tensor(A, dtype=F64), torch.ones(2, 2, dtype=F64),
                       loss_type="dapo").loss.item()
    assert metrics["clip_cov/clipped_frac"] == 0.0 and loss == pytest.approx(dapo, abs=1e-15)


def test_sampled_count_and_reproducibility():
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(8, 16, generator=g, dtype=F64) * 6).tolist()
    adv = (torch.randn(8, generator=g, dtype=F64) * 3).tolist()
    m = [[1] * 16] * 8
    kw = dict(clip_cov_ratio=0.05, clip_cov_lb=0.1, clip_cov_ub=100.0)
    eligible = (token_covariance(torch.tensor(lp, dtype=F64), torch.tensor(adv, dtype=F64).unsqueeze(-1),
                                 torch.ones(8, 16, dtype=F64)) > 0.1).sum().item()
    assert eligible > 6
    picked = {}
    for seed in (0, 0, 1):
        _, grad, metrics = _run(lp, None, adv, m, seed=seed, **kw)
        off = [(i, t) for i in range(8) for t in range(16) if grad[i][t] == 0.0]
        assert len(off) == math.floor(0.05 * 128) == 6  # ⌊ratio·N⌋ tokens, all with zero gradient
        assert metrics["clip_cov/clipped_frac"] == 6 / 128
        picked.setdefault(seed, []).append(off)
    assert picked[0][0] == picked[0][1]  # the same generator picks the same tokens
    assert picked[0][0] != picked[1][0]


def test_masked_tokens_are_never_picked():
    m = [[1, 0], [1, 1]]
    _, grad, metrics = _run(LP, None, A, m, clip_cov_lb=-10.0, clip_cov_ub=10.0, clip_cov_ratio=1.0)
    assert grad[0][1] == 0.0 and metrics["clip_cov/clipped_frac"] == 1.0  # every valid token switched off


def test_settings_and_config_fields_come_from_the_description():
    from grpokit import GRPOConfig

    s = LossSettings.from_config(GRPOConfig(output_dir="/tmp/cc", loss_type="clip_cov", clip_cov_ratio=0.01))
    assert s.params == ClipCovParams(ratio=0.01)
    with pytest.raises(ValueError, match=r"clip_cov_ub=0\.5 must be larger than clip_cov_lb=1\.0"):
        GRPOConfig(output_dir="/tmp/cc", loss_type="clip_cov", clip_cov_ub=0.5)
    with pytest.raises(ValueError, match=r"clip_cov_ratio=0 is not allowed: must be > 0"):
        GRPOConfig(output_dir="/tmp/cc", loss_type="clip_cov", clip_cov_ratio=0)
    with pytest.raises(ValueError, match="epsilon_high"):
        GRPOConfig(output_dir="/tmp/cc", loss_type="clip_cov", epsilon=0.3, epsilon_high=0.2)
