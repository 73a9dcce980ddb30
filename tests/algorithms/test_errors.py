"""Family 6: clear errors. A ValueError whose message names the argument, the value given and what is allowed."""

from __future__ import annotations

import re

import pytest
import torch

from grpokit.algorithms import (
    LOSS_TYPES,
    LOSSES,
    aggregate_loss,
    compute_advantages,
    overlong_penalty,
    policy_loss,
    sampler_importance_ratio,
)

F64 = torch.float64


def _inputs(B=2, T=3):
    lp = -torch.rand(B, T, dtype=F64)
    return lp, lp - 0.1, torch.tensor([1.0, -1.0][:B], dtype=F64), torch.ones(B, T, dtype=F64)


def test_unknown_loss_type_names_value_and_allowed():
    lp, old, A, m = _inputs()
    with pytest.raises(ValueError) as e:
        policy_loss(lp, old, A, m, loss_type="ppo")
    msg = str(e.value)
    assert "loss_type" in msg and "'ppo'" in msg
    for name in LOSS_TYPES:
        assert name in msg
    assert {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo", "gmpo", "clip_cov",
            "kl_cov"} <= set(LOSS_TYPES)


def test_unknown_level_names_value_and_allowed():
    lp, old, A, m = _inputs()
    with pytest.raises(ValueError) as e:
        policy_loss(lp, old, A, m, importance_sampling_level="tokens")
    msg = str(e.value)
    assert "importance_sampling_level" in msg and "'tokens'" in msg
    for name in ("token", "sequence", "sequence_token"):
        assert re.search(rf"\b{name}\b", msg)


@pytest.mark.parametrize("arg", ["mask", "old_logps", "ref_logps", "entropies", "sampler_logps", "sampler_ratio"])
def test_shape_mismatch_names_the_argument_and_shapes(arg):
    lp, old, A, m = _inputs()
    kw = dict(old_logps=old, mask=m, beta=0.1, ref_logps=lp.clone(), entropies=torch.ones_like(lp),
              sampler_logps=lp.clone(), sampler_ratio=torch.ones_like(lp))
    kw[arg] = torch.ones(2, 5, dtype=F64)
    with pytest.raises(ValueError) as e:
        policy_loss(lp, kw.pop("old_logps"), A, kw.pop("mask"), loss_type="grpo", **kw)
    msg = str(e.value)
    assert arg in msg and "(2, 5)" in msg and "(2, 3)" in msg


def test_advantages_shape_mismatch():
    lp, old, _, m = _inputs()
    with pytest.raises(ValueError, match=r"advantages.*\(3,\).*\(2,\)"):
        policy_loss(lp, old, torch.ones(3, dtype=F64), m)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, old, torch.ones(2, 3, dtype=F64), m)


def test_logps_must_be_two_dimensional():
    with pytest.raises(ValueError, match=r"logps.*\(4,\)"):
        policy_loss(torch.zeros(4, dtype=F64), None, torch.zeros(4, dtype=F64), torch.ones(4, dtype=F64))


def test_sequence_level_sampler_ratio_rejected_for_vespo():
    lp, old, A, m = _inputs()
    with pytest.raises(ValueError) as e:
        policy_loss(lp, old, A, m, loss_type="vespo", sampler_ratio=torch.ones(2, 1, dtype=F64))
    msg = str(e.value)
    assert "sampler_ratio" in msg and "(2, 1)" in msg and "'vespo'" in msg and "token" in msg
    # the same (B, 1) ratio is fine for every other loss, and a token-level one is fine for VESPO
    for loss_type in LOSS_TYPES:
        if LOSSES[loss_type].sampler_ratio != "fold":
            policy_loss(lp, old, A, m, loss_type=loss_type, sampler_ratio=torch.ones(2, 1, dtype=F64))
    policy_loss(lp, old, A, m, loss_type="vespo", sampler_ratio=torch.ones(2, 3, dtype=F64))


def test_beta_without_ref_logps():
    lp, old, A, m = _inputs()
    with pytest.raises(ValueError) as e:
        policy_loss(lp, old, A, m, beta=0.04)
    msg = str(e.value)
    assert "beta" in msg and "0.04" in msg and "ref_logps" in msg
    policy_loss(lp, old, A, m, beta=0.0)  # beta = 0 needs no reference model


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5])
def test_top_entropy_quantile_out_of_range(q):
    lp, old, A, m = _inputs()
    with pytest.raises(ValueError, match=rf"top_entropy_quantile={q}.*\(0, 1\]"):
        policy_loss(lp, old, A, m, top_entropy_quantile=q, entropies=torch.ones_like(lp))


def test_top_entropy_quantile_needs_entropies():
    lp, old, A, m = _inputs()
    with pytest.raises(ValueError, match="entropies"):
        policy_loss(lp, old, A, m, top_entropy_quantile=0.2)


def test_aggregate_loss_unknown_type():
    with pytest.raises(ValueError, match=r"aggregation='nope'.*global_token_mean"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), "nope")


def test_sampler_importance_ratio_unknown_mode():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError) as e:
        sampler_importance_ratio(x, x, torch.ones(2, 3), mode="token_clip")
    msg = str(e.value)
    assert "'token_clip'" in msg
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        assert mode in msg


def test_advantages_rows_not_divisible_by_num_generations():
    with pytest.raises(ValueError) as e:
        compute_advantages(torch.zeros(7, 1), 4)
    msg = str(e.value)
    assert "7" in msg and "num_generations=4" in msg


def test_advantages_bad_scale_rewards():
    with pytest.raises(ValueError) as e:
        compute_advantages(torch.zeros(4, 1), 2, scale_rewards="std")
    msg = str(e.value)
    assert "scale_rewards" in msg and "'std'" in msg
    for allowed in ("group", "batch", "none"):
        assert allowed in msg


def test_advantages_bad_aggregation_estimator_and_weights():
    with pytest.raises(ValueError, match=r"multi_objective_aggregation='mean'.*normalize_then_sum"):
        compute_advantages(torch.zeros(4, 1), 2, multi_objective_aggregation="mean")
    with pytest.raises(ValueError, match=r"advantage_estimator='ppo'.*rloo"):
        compute_advantages(torch.zeros(4, 1), 2, advantage_estimator="ppo")
    with pytest.raises(ValueError, match=r"reward_weights.*3.*2"):
        compute_advantages(torch.zeros(4, 2), 2, reward_weights=[1.0, 1.0, 1.0])


def test_overlong_penalty_needs_a_positive_buffer():
    with pytest.raises(ValueError, match="overlong_buffer_length=0"):
        overlong_penalty(torch.tensor([3]), 10, 0)
