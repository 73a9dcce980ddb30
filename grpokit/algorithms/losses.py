"""Per-token policy losses ``ℓ[i,t]`` of the GRPO family, one function each, in a registry
(ALGORITHMS.md §2).

Every loss takes a :class:`LossContext` and returns ``(ℓ, metrics)``. ``ℓ`` is (B, T) or (B, 1) (one value per
row, broadcast over its tokens by the aggregation); ``metrics`` holds detached 0-dim tensors (no host sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .importance import LOG_RATIO_CLAMP


@dataclass
class LossContext:
    """What a per-token loss may read. ``A`` is (B, 1); ``log_w`` is the level's log-ratio (B, T) or (B, 1);
    ``d`` is always the token-level log-ratio (B, T); ``lp`` the current log-probs (grad flows)."""

    lp: torch.Tensor
    d: torch.Tensor
    log_w: torch.Tensor
    A: torch.Tensor
    mask: torch.Tensor
    eps_lo: float
    eps_hi: float
    delta: float | None = None
    sampler_ratio: torch.Tensor | None = None
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05


LossFn = Callable[[LossContext], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
LOSSES: dict[str, LossFn] = {}


def register_loss(*names: str) -> Callable[[LossFn], LossFn]:
    """Register a per-token loss under one or more ``loss_type`` names."""

    def wrap(fn: LossFn) -> LossFn:
        for name in names:
            LOSSES[name] = fn
        return fn

    return wrap


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over valid tokens, or over rows when ``x`` is (B, 1) (one value per sequence).
    Detached; 0 when nothing is valid."""
    x = x.detach().to(mask.dtype)
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.mean() if x.numel() else x.sum()
    x = x.expand_as(mask)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _where(cond: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """``torch.where`` of two hyper-parameters in ``like``'s dtype (python floats would pass through float32)."""
    true = torch.tensor(if_true, dtype=like.dtype, device=like.device)
    false = torch.tensor(if_false, dtype=like.dtype, device=like.device)
    return torch.where(cond, true, false)


def _clip_metrics(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/region_mean": masked_mean(low | high, mask),
    }


@register_loss("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
def clipped_surrogate_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (GRPO, arXiv 2402.03300 eq. 3; DAPO's clip-higher uses ``eps_hi ≠ eps_lo``):

    ``ℓ = -min(r₁·A, clip(r, 1-ε_lo, 1+ε_hi)·A)`` with ``r = exp(log_w)`` and ``r₁ = min(r, δ)`` when the
    two-sided bound ``delta`` is set (INTELLECT-2), else ``r₁ = r``.
    """
    r = torch.exp(c.log_w)
    r_clipped = torch.clamp(r, 1.0 - c.eps_lo, 1.0 + c.eps_hi)
    r_first = torch.clamp(r, max=c.delta) if c.delta is not None else r
    loss = -torch.min(r_first * c.A, r_clipped * c.A)
    low = (r < 1.0 - c.eps_lo) & (c.A < 0)
    high = (r > 1.0 + c.eps_hi) & (c.A > 0)
    return loss, _clip_metrics(low, high, c.mask)


@register_loss("cispo")
def cispo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585 eq. 4): REINFORCE with a clipped, detached IS weight,

    ``ℓ = -sg[min(r, ε_hi)]·A·lp``. ``ε_hi`` is an absolute cap on the weight (not ``1+ε``).
    """
    r = torch.exp(c.log_w)
    weight = torch.clamp(r, max=c.eps_hi).detach()
    loss = -weight * c.A * c.lp
    clipped = (r > c.eps_hi) & (c.A > 0)
    return loss, {"cispo_clip_ratio": masked_mean(clipped, c.mask)}


@register_loss("sapo")
def sapo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (arXiv 2511.20347): a soft sigmoid gate instead of a hard clip,

    ``ℓ = -σ(τ(r-1))·(4/τ)·A`` with ``τ = τ_pos`` if ``A > 0`` else ``τ_neg``; at ``r = 1`` the gradient equals
    the unclipped surrogate's, and it decays smoothly as ``r`` leaves 1.
    """
    r = torch.exp(c.log_w)
    tau = _where(c.A > 0, c.sapo_temperature_pos, c.sapo_temperature_neg, r)
    loss = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * c.A
    return loss, {}


@torch.no_grad()
def vespo_weights(c: LossContext) -> tuple[torch.Tensor, torch.Tensor]:
    """VESPO's detached sequence weight (arXiv 2602.10693), returns ``(φ, log W)``, each (B, 1).

    ``log W_i = clamp(Σ_t m·d [+ Σ_t m·clamp(log ρ, log 1e-8, 20)], log 1e-8, 20)`` (a *sum*: the true sequence
    ratio), ``φ = exp(λ + k·log W - λ·W) = W^k·e^{λ(1-W)}`` with ``(k, λ)`` by the sign of ``A``; ``φ(1) = 1``.
    """
    low = math.log(1e-8)
    seq = (c.d * c.mask).sum(-1, keepdim=True)
    if c.sampler_ratio is not None:
        log_rho = torch.log(c.sampler_ratio.to(seq.dtype)).clamp(low, LOG_RATIO_CLAMP)
        seq = seq + (log_rho * c.mask).sum(-1, keepdim=True)
    log_w = seq.clamp(low, LOG_RATIO_CLAMP)
    nonneg = c.A >= 0
    k = _where(nonneg, c.vespo_k_pos, c.vespo_k_neg, log_w)
    lam = _where(nonneg, c.vespo_lambda_pos, c.vespo_lambda_neg, log_w).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0), log_w


@register_loss("vespo")
def vespo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: ``ℓ = -φ_i·A_i·lp[i,t]`` with the detached gamma-shaped weight ``φ`` of :func:`vespo_weights`.

    On-policy ``φ ≡ 1`` and this is REINFORCE with group advantages.
    """
    phi, log_w = vespo_weights(c)
    loss = -phi * c.A * c.lp
    pos, neg = (c.A >= 0).to(phi.dtype), (c.A < 0).to(phi.dtype)
    metrics = {
        "vespo/phi_seq_mean": phi.mean(),
        "vespo/w_seq_mean": torch.exp(log_w).mean(),
        "vespo/log_w_seq_mean": log_w.mean(),
        "vespo/phi_pos_mean": (phi * pos).sum() / pos.sum().clamp(min=1.0),
        "vespo/phi_neg_mean": (phi * neg).sum() / neg.sum().clamp(min=1.0),
    }
    return loss, metrics


@register_loss("gmpo")
def gmpo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (arXiv 2507.20673 eq. 4): maximise the geometric mean of token ratios, clipped in log space.

    ``d* = sgn(A)·min(sgn(A)·d, sgn(A)·clip(d, -ε_lo, ε_hi))``, ``ℓ_i = -A_i·exp(Σ_t m·d* / max(1, Σ_t m))``,
    one value per row (B, 1). Always built from token-level ratios, whatever the level setting.
    """
    sign = torch.sign(c.A)
    clipped = torch.clamp(c.d, -c.eps_lo, c.eps_hi)
    d_star = sign * torch.min(sign * c.d, sign * clipped)
    mean_log = (d_star * c.mask).sum(-1, keepdim=True) / c.mask.sum(-1, keepdim=True).clamp(min=1.0)
    loss = -c.A * torch.exp(mean_log)
    low = (c.d < -c.eps_lo) & (c.A < 0)
    high = (c.d > c.eps_hi) & (c.A > 0)
    return loss, _clip_metrics(low, high, c.mask)


LOSS_TYPES = tuple(LOSSES)
