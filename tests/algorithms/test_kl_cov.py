"""KL-Cov: hand-computed values and gradients, the top-k selection by covariance, and its configuration fields."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import LossSettings, policy_loss
from grpokit.algorithms.losses.kl_cov import KlCovParams

F64 = torch.float64


def flat(rows):
    return [v for row in rows for v in row]

A = [1.0, -1.0]


def _run(lp, old, m, **kw):
    x = torch.tensor(lp, dtype=F64, requires_grad=True)
    out = policy_loss(x, torch.tensor(old, dtype=F64), torch.tensor(A, dtype=F64), torch.tensor(m, dtype=F64),
                      loss_type="kl_cov", **kw)
    out.loss.backward()
    return out.loss.item(), x.grad.tolist(), {k: v.item() for k, v in out.metrics.items()}


def test_top_token_gets_the_penalty_by_hand():
    # lp mean -2, A mean 0: covariances [[1, -1], [0, 0]]; ⌊2e-4·4⌋ rounds up to 1 token: (0, 0).
    # d = 0.1 everywhere, r = e^0.1: ℓ = -r·A (+ 1·|d| on (0, 0)); global token mean over 4 tokens.
    lp = [[-1.0, -3.0], [-2.0, -2.0]]
    old = [[x - 0.1 for x in row] for row in lp]
    r = math.exp(0.1)
    loss, grad, metrics = _run(lp, old, [[1, 1], [1, 1]])
    assert loss == pytest.approx((-r + 0.1 - r + r + r) / 4, rel=1e-12)
    assert flat(grad) == pytest.approx(flat([[(-r + 1.0) / 4, -r / 4], [r / 4, r / 4]]), rel=1e-12)
    assert metrics["kl_cov/penalised_frac"] == 0.25
    assert metrics["kl_cov/abs_log_ratio_mean"] == pytest.approx(0.1, rel=1e-12)


def test_ratio_selects_the_k_largest_covariances():
    # covariances: row 0 (A=1): [1.125, -0.875]; row 1 (A=-1): [-0.125, 0.375]; k = ⌊0.5·4⌋ = 2: (0,0) and (1,1)
    lp = [[-1.0, -3.0], [-2.0, -2.5]]
    old = [[x + 0.2 for x in row] for row in lp]  # d = -0.2: the penalty's gradient is -coef on chosen tokens
    r = math.exp(-0.2)
    loss, grad, metrics = _run(lp, old, [[1, 1], [1, 1]], kl_cov_ratio=0.5, kl_cov_coef=2.0)
    assert metrics["kl_cov/penalised_frac"] == 0.5
    assert flat(grad) == pytest.approx(flat([[(-r - 2.0) / 4, -r / 4], [r / 4, (r - 2.0) / 4]]), rel=1e-12)
    assert loss == pytest.approx((-r + 0.4 - r + r + r + 0.4) / 4, rel=1e-12)


def test_no_clipping_far_off_policy():
    # unlike PPO the surrogate is not clipped: a ratio of e^1 keeps its gradient
    lp, old = [[0.0, 0.0], [0.0, 0.0]], [[-1.0, -1.0], [-1.0, -1.0]]
    _, grad, _ = _run(lp, old, [[1, 1], [1, 1]], kl_cov_coef=0.0)
    assert grad[0][1] == pytest.approx(-math.e / 4, rel=1e-12)


def test_on_policy_it_is_reinforce():
    lp = [[-1.0, -3.0], [-2.0, -2.0]]
    loss, grad, _ = _run(lp, lp, [[1, 1], [1, 0]])
    assert loss == pytest.approx((-1 - 1 + 1) / 3, rel=1e-12)
    assert flat(grad) == pytest.approx(flat([[-1 / 3, -1 / 3], [1 / 3, 0.0]]), rel=1e-12)


def test_settings_and_config_fields_come_from_the_description():
    from grpokit import GRPOConfig

    c = GRPOConfig(output_dir="/tmp/kc", loss_type="kl_cov", kl_cov_ratio=0.002, loss_params={"coef": 0.5})
    assert LossSettings.from_config(c).params == KlCovParams(ratio=0.002, coef=0.5)
    with pytest.raises(ValueError, match=r"kl_cov_coef=-1 is not allowed: must be >= 0"):
        GRPOConfig(output_dir="/tmp/kc", loss_type="kl_cov", kl_cov_coef=-1)
    with pytest.raises(ValueError, match=r"loss_params key 'k' is not a parameter of loss_type='kl_cov'"):
        GRPOConfig(output_dir="/tmp/kc", loss_type="kl_cov", loss_params={"k": 1})
