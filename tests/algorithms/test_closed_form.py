"""The closed-form engine of ``policy_loss`` (value and gradient together, no autograd graph) against the
autograd engine (the definitions in ``losses.py`` differentiated by torch): same loss, gradient and metrics for
every loss type, level and option, including extreme log-ratios, empty rows and fully masked batches."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpokit.algorithms import policy_loss
from grpokit.algorithms.aggregation import AGGREGATIONS, aggregate_loss, aggregation_weights
from grpokit.algorithms.losses import LOSSES

from ._common import CLOSED_FORM_LOSSES, LEVELS, REFERENCE_LOSSES, make_case
from .test_properties import SETTINGS, batches


def _both(lp, old, A, m, **kw):
    out = {}
    for engine in ("autograd", "closed_form"):
        x = lp.detach().clone().requires_grad_(True)
        res = policy_loss(x, old, A, m, engine=engine, **kw)
        res.loss.backward()
        out[engine] = (res.loss.detach(), x.grad if x.grad is not None else torch.zeros_like(x), res.metrics)
    return out


def _assert_same(out, rel, abs_):
    (la, ga, ma), (lc, gc, mc) = out["autograd"], out["closed_form"]
    assert la.dtype == lc.dtype
    torch.testing.assert_close(lc, la, rtol=rel, atol=abs_, equal_nan=True)
    torch.testing.assert_close(gc, ga, rtol=rel, atol=abs_, equal_nan=True)
    assert ma.keys() == mc.keys()
    for k in ma:
        assert not mc[k].requires_grad and mc[k].dim() == 0, k
        torch.testing.assert_close(mc[k], ma[k], rtol=rel, atol=abs_, equal_nan=True, msg=k)


def test_every_reference_loss_has_a_closed_form():
    # the losses that select tokens by batch statistics (clip_cov, kl_cov) are defined by autograd only
    assert set(REFERENCE_LOSSES) <= set(CLOSED_FORM_LOSSES)
    assert all(LOSSES[name].closed_form is None for name in set(LOSSES) - set(CLOSED_FORM_LOSSES))


OPTIONS = {
    "default": {},
    "delta": dict(epsilon=0.1, epsilon_high=0.28, delta=1.2),
    "kl": dict(beta=0.04, ref_logps="ref"),
    "kl_bias": dict(beta=0.04, ref_logps="ref", use_bias_correction_kl=True),
    "masks": dict(top_entropy_quantile=0.4, off_policy_mask_threshold=0.0, sampler_logps="sampler_lp"),
    "token_ratio": dict(sampler_ratio="rho_tok"),
    "seq_ratio": dict(sampler_ratio="rho_seq"),
    "aggregation": dict(max_completion_length=9, num_items_in_batch=57, gradient_accumulation_steps=4,
                        steps_per_generation=2, num_processes=2),
    "on_policy": dict(old=None),
    "everything": dict(epsilon=0.15, epsilon_high=0.3, delta=1.5, beta=0.02, ref_logps="ref",
                       use_bias_correction_kl=True, top_entropy_quantile=0.5, sampler_ratio="rho_tok",
                       off_policy_mask_threshold=0.01, sampler_logps="sampler_lp"),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", CLOSED_FORM_LOSSES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_closed_form_equals_autograd(loss_type, level, option, dtype):
    if loss_type == "vespo" and option == "seq_ratio":
        pytest.skip("rejected for VESPO by design")
    seed = zlib.crc32(f"{loss_type}/{level}/{option}".encode()) % 1000
    case = make_case(seed=seed, B=5, T=6, sigma=0.4, p_mask=0.3, dtype=dtype)
    case["m"][3] = 0.0  # an empty row
    kw = {k: (case[v] if isinstance(v, str) else v) for k, v in OPTIONS[option].items() if k != "old"}
    old = None if "old" in OPTIONS[option] else case["old"]
    out = _both(case["lp"], old, case["A"], case["m"], loss_type=loss_type, importance_sampling_level=level,
                entropies=case["ent"], **kw)
    tol = (1e-12, 1e-14) if dtype == torch.float64 else (2e-5, 1e-6)
    _assert_same(out, *tol)


@pytest.mark.parametrize("loss_type", CLOSED_FORM_LOSSES)
@SETTINGS
@given(b=batches(), level=st.sampled_from(LEVELS))
def test_closed_form_equals_autograd_on_extreme_batches(loss_type, b, level):
    # ±1e4 log-ratios (clamped at ±20), zero and huge advantages, empty rows, all-masked batches
    if loss_type == "vespo" and "sampler_ratio" in b["extras"] and b["extras"]["sampler_ratio"].shape[-1] == 1:
        return
    out = _both(b["lp"], b["old"], b["A"], b["m"], loss_type=loss_type, importance_sampling_level=level, **b["extras"])
    rel = 1e-9 if b["lp"].dtype == torch.float64 else 1e-4
    scale = max(1.0, out["autograd"][1].abs().max().item(), abs(out["autograd"][0].item()))
    if not math.isfinite(scale):
        scale = 1.0
    _assert_same(out, rel, rel * scale)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregation_weights_give_aggregate_loss(aggregation):
    case = make_case(seed=5, B=4, T=7)
    ell = torch.randn(4, 7, dtype=torch.float64)
    kw = dict(max_completion_length=11, num_items_in_batch=13.0, gradient_accumulation_steps=3,
              steps_per_generation=2, num_processes=2)
    w = aggregation_weights(case["m"], aggregation, **kw)
    assert (w * ell).sum().item() == pytest.approx(aggregate_loss(ell, case["m"], aggregation, **kw).item(), rel=1e-12)


def test_closed_form_engine_options():
    case = make_case(seed=1)
    x = case["lp"].clone().requires_grad_(True)
    out = policy_loss(x, case["old"], case["A"], case["m"], loss_type="dapo")
    assert type(out.loss.grad_fn).__name__ == "_WithGradientBackward"
    with torch.no_grad():
        assert not policy_loss(x, case["old"], case["A"], case["m"]).loss.requires_grad
    with pytest.raises(ValueError, match="engine"):
        policy_loss(x, case["old"], case["A"], case["m"], engine="fast")
