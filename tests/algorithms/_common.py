"""Shared helpers for the algorithm tests: seeded inputs, list conversion, one call of ``policy_loss``."""

from __future__ import annotations

import math

import torch

from grpokit.algorithms import LOSSES, policy_loss

LOSS_TYPES = tuple(LOSSES)
"""Every registered loss: the generic properties (gradients, masks, aggregation, extreme inputs) are tested for
each, so a new loss module gets them without touching this folder."""
REFERENCE_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo", "gmpo")
"""The losses restated in plain Python by ``_pyref.py`` (and in tests/reference/): checked value by value. A loss
added later brings its own hand-computed tests (e.g. test_clip_cov.py)."""
BATCH_INDEPENDENT = tuple(name for name in LOSS_TYPES if not LOSSES[name].batch_dependent)
"""Losses whose per-token term does not depend on the other rows of the micro-batch (splitting invariance holds)."""
CLOSED_FORM_LOSSES = tuple(name for name in LOSS_TYPES if LOSSES[name].closed_form is not None)
LEVELS = ("token", "sequence", "sequence_token")
CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def tolist(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().tolist()
    return x


def make_case(seed: int, B: int = 3, T: int = 4, sigma: float = 0.3, p_mask: float = 0.25,
              dtype=torch.float64) -> dict:
    """Random but seeded inputs: moderately off-policy ratios (d ~ N(0, sigma)), some masked tokens (every row
    keeps at least one), mixed-sign advantages, a reference policy, entropies (float32-exact), sampler log-probs
    and token/sequence sampler ratios (1 on masked tokens, as the trainer's own computation gives)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0 - 0.05
    d = torch.randn(B, T, generator=g, dtype=torch.float64) * sigma
    lp = old + d
    m = (torch.rand(B, T, generator=g, dtype=torch.float64) > p_mask).to(torch.float64)
    m[:, 0] = 1.0
    A = torch.randn(B, generator=g, dtype=torch.float64)
    if B >= 2:
        A[0], A[1] = abs(A[0]) + 0.1, -abs(A[1]) - 0.1
    ref = lp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    ent = (torch.rand(B, T, generator=g) * 2.0).to(torch.float64)  # float32-exact values
    sampler_lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    rho_tok = torch.exp(torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2) * m + (1 - m)
    rho_seq = torch.exp(torch.randn(B, 1, generator=g, dtype=torch.float64) * 0.3)
    out = dict(lp=lp, old=old, A=A, m=m, ref=ref, ent=ent, sampler_lp=sampler_lp, rho_tok=rho_tok, rho_seq=rho_seq)
    return {k: v.to(dtype) for k, v in out.items()}


def run_ours(lp, old, A, m, **kw):
    """``policy_loss`` on a fresh leaf copy of ``lp``; returns (loss float, grad (B,T) tensor, metrics)."""
    x = lp.detach().clone().requires_grad_(True)
    out = policy_loss(x, old, A, m, **kw)
    out.loss.backward()
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return out.loss.item(), grad, out.metrics


def assert_close(actual: float, expected: float, rel: float = 1e-9, abs_: float = 1e-12, what: str = "") -> None:
    assert math.isfinite(actual), f"{what}: {actual} is not finite"
    assert abs(actual - expected) <= max(abs_, rel * abs(expected)), f"{what}: got {actual!r}, expected {expected!r}"


def assert_grid_close(actual, expected, rel: float = 1e-9, abs_: float = 1e-12, what: str = "") -> None:
    actual = tolist(actual)
    expected = tolist(expected)
    assert len(actual) == len(expected), what
    for i, (ra, re_) in enumerate(zip(actual, expected)):
        for t, (a, e) in enumerate(zip(ra, re_)):
            assert_close(a, e, rel, abs_, what=f"{what}[{i},{t}]")
