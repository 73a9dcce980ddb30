"""Family 5: property tests (hypothesis): finite loss and gradient whatever the inputs, for every loss type and
level — extreme log-ratios (±1e4), empty rows, all-masked batches, zero advantages, B = 1, T = 1 — and a few
structural invariants (masked tokens are inert, padding can be appended, scaling laws of the aggregation)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpokit.algorithms import policy_loss

from ._common import LEVELS, LOSS_TYPES

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=True)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    mag = draw(st.sampled_from([0.0, 0.3, 5.0, 50.0, 1e4]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 10.0
    d = (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * mag
    lp = (old + d).clamp(max=0.0)  # log-probs stay ≤ 0, but can be −1e4
    mask_kind = draw(st.sampled_from(["random", "all", "none", "empty_row"]))
    if mask_kind == "random":
        m = (torch.rand(B, T, generator=g) > 0.4).to(torch.float64)
    elif mask_kind == "all":
        m = torch.ones(B, T, dtype=torch.float64)
    elif mask_kind == "none":
        m = torch.zeros(B, T, dtype=torch.float64)
    else:
        m = torch.ones(B, T, dtype=torch.float64)
        m[draw(st.integers(0, B - 1))] = 0.0
    adv_kind = draw(st.sampled_from(["random", "zero", "huge"]))
    A = {"random": torch.randn(B, generator=g, dtype=torch.float64),
         "zero": torch.zeros(B, dtype=torch.float64),
         "huge": torch.randn(B, generator=g, dtype=torch.float64) * 1e3}[adv_kind]
    ref = (lp + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * mag).clamp(max=0.0)
    on_policy = draw(st.booleans())
    extras = {}
    if draw(st.booleans()):
        extras.update(beta=draw(st.sampled_from([0.01, 1.0])), ref_logps=ref.to(dtype),
                      use_bias_correction_kl=draw(st.booleans()))
    if draw(st.booleans()):
        rho = torch.exp((torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * min(mag, 30.0))
        rho = rho * (torch.rand(B, T, generator=g) > 0.2)  # some masked-out (0) ratios, as token_mask gives
        extras["sampler_ratio"] = rho.to(dtype)
    if draw(st.booleans()):
        extras.update(entropies=(torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(dtype),
                      top_entropy_quantile=draw(st.sampled_from([0.2, 0.5, 1.0])))
    if draw(st.booleans()):
        extras.update(off_policy_mask_threshold=draw(st.sampled_from([0.0, 1.0])),
                      sampler_logps=(old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * mag).to(dtype))
    extras.update(
        delta=draw(st.sampled_from([None, 1.5])),
        epsilon_high=draw(st.sampled_from([None, 0.28, 5.0])),
        max_completion_length=draw(st.sampled_from([None, 8])),
        num_items_in_batch=draw(st.sampled_from([None, 0, 3, 100])),
        gradient_accumulation_steps=draw(st.sampled_from([1, 3])),
    )
    return dict(lp=lp.to(dtype), old=None if on_policy else old.to(dtype), A=A.to(dtype), m=m.to(dtype),
                extras=extras)


def _run(b, loss_type, level):
    x = b["lp"].detach().clone().requires_grad_(True)
    out = policy_loss(x, b["old"], b["A"], b["m"], loss_type=loss_type, importance_sampling_level=level, **b["extras"])
    out.loss.backward()
    return out, x.grad if x.grad is not None else torch.zeros_like(x)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@SETTINGS
@given(b=batches(), level=st.sampled_from(LEVELS))
def test_loss_and_gradient_are_always_finite(loss_type, b, level):
    out, grad = _run(b, loss_type, level)
    assert out.loss.dim() == 0
    assert out.loss.dtype == b["lp"].dtype
    assert torch.isfinite(out.loss), out.loss
    assert torch.isfinite(grad).all()
    assert (grad[b["m"] == 0] == 0).all()
    for name, value in out.metrics.items():
        assert value.dim() == 0 and not value.requires_grad, name
        # the row extremes are taken over rows with a valid token (token level): with none they are NaN, as in
        # TRL, and left out at log time
        nan_ok = name in ("clip_ratio/low_min", "clip_ratio/high_max") and not (b["m"].sum(-1) > 0).any()
        assert torch.isfinite(value) or (nan_ok and torch.isnan(value)), name
    if b["m"].sum() == 0:  # nothing counts: the policy term is 0 (and so is the KL after masking)
        assert out.loss.item() == 0.0
        assert (grad == 0).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@SETTINGS
@given(b=batches(), level=st.sampled_from(LEVELS))
def test_zero_advantages_leave_only_the_kl_term(loss_type, b, level):
    if loss_type == "kl_cov":
        pytest.skip("KL-Cov's |log-ratio| penalty is itself a KL-like term, independent of A (test_cov_losses.py)")
    b["A"] = torch.zeros_like(b["A"])
    b["extras"].pop("beta", None)
    b["extras"].pop("ref_logps", None)
    out, grad = _run(b, loss_type, level)
    assert out.loss.item() == 0.0
    assert (grad == 0).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), level=st.sampled_from(LEVELS), pad=st.integers(1, 3),
       junk=st.sampled_from([0.0, 7.0, -1e4]))
def test_masked_tokens_and_padding_are_inert(loss_type, seed, level, pad, junk):
    # Appending padding columns (any values, masked out) changes neither the loss nor the valid gradients,
    # with max_completion_length / num_items_in_batch fixed (they are properties of the batch, not of T).
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 4
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    m = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)
    A = torch.randn(B, generator=g, dtype=torch.float64)
    kw = dict(loss_type=loss_type, importance_sampling_level=level, max_completion_length=10, num_items_in_batch=9)
    x1 = lp.clone().requires_grad_(True)
    l1 = policy_loss(x1, old, A, m, generator=torch.Generator().manual_seed(0), **kw).loss
    l1.backward()
    padded = lambda t, v: torch.cat([t, torch.full((B, pad), v, dtype=t.dtype)], dim=1)  # noqa: E731
    x2 = padded(lp, junk).requires_grad_(True)
    l2 = policy_loss(x2, padded(old, -3.0), A, padded(m, 0.0), generator=torch.Generator().manual_seed(0), **kw).loss
    l2.backward()
    assert torch.allclose(l1, l2, rtol=1e-12, atol=1e-15)
    assert torch.allclose(x1.grad, x2.grad[:, :T], rtol=1e-12, atol=1e-15)
    assert (x2.grad[:, T:] == 0).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), level=st.sampled_from(LEVELS), ga=st.integers(1, 8))
def test_loss_scales_as_one_over_gradient_accumulation(loss_type, seed, level, ga):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(2, 3, generator=g, dtype=torch.float64)
    lp = old + torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.2
    A = torch.randn(2, generator=g, dtype=torch.float64)
    m = torch.ones(2, 3, dtype=torch.float64)
    base = policy_loss(lp, old, A, m, loss_type=loss_type, importance_sampling_level=level,
                       generator=torch.Generator().manual_seed(0)).loss
    scaled = policy_loss(lp, old, A, m, loss_type=loss_type, importance_sampling_level=level,
                         gradient_accumulation_steps=ga, steps_per_generation=1, num_items_in_batch=6,
                         generator=torch.Generator().manual_seed(0)).loss
    assert torch.allclose(scaled * ga, base, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_edge_shapes(loss_type, level):
    for B, T in [(1, 1), (1, 5), (4, 1), (0, 3)]:
        lp = -torch.rand(B, T, dtype=torch.float64) - 0.1
        old = lp - 0.1
        x = lp.clone().requires_grad_(True)
        out = policy_loss(x, old, torch.ones(B, dtype=torch.float64), torch.ones(B, T, dtype=torch.float64),
                          loss_type=loss_type, importance_sampling_level=level)
        out.loss.backward()
        assert torch.isfinite(out.loss), (B, T)
        if B == 0:
            assert out.loss.item() == 0.0
        else:
            assert torch.isfinite(x.grad).all()
