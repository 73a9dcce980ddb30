"""What a per-token loss reads (:class:`LossContext`) and what its closed form returns (:class:`ClosedForm`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LossContext:
    """The inputs of a per-token loss ``ℓ[i,t]``. ``A`` is (B, 1); ``log_w`` is the level's log-ratio (B, T) or
    (B, 1); ``d`` is always the token-level log-ratio ``clamp(lp - old, ±20)`` (B, T); ``lp`` the current log-probs
    (grad flows); ``params`` the loss's own hyper-parameters (its spec's ``params`` dataclass, or None)."""

    lp: torch.Tensor
    d: torch.Tensor
    log_w: torch.Tensor
    A: torch.Tensor
    mask: torch.Tensor
    eps_lo: float
    eps_hi: float
    delta: float | None = None
    params: Any = None
    sampler_ratio: torch.Tensor | None = None
    """The rollout engine's token-level ratio ``ρ`` (B, T), given only to losses that fold it into their own weight
    (``sampler_ratio="fold"``); every other loss is multiplied by it afterwards."""
    mask_denom: torch.Tensor | None = None
    """``max(1, Σ mask)`` when already computed (saves a pass)."""
    generator: torch.Generator | None = None
    """Randomness for losses that sample tokens (Clip-Cov); None: torch's global generator."""


@dataclass
class LossWeights:
    """``E = ∂loss/∂ℓ = mask·scale·keep`` (B, T), kept in factors: ``scale`` is the aggregation's one over its
    normaliser, per row (B, 1) or one number; ``keep`` the detached multipliers of ``ℓ`` (masks, sampler ratio)
    or None; ``rows`` is ``Σ_t mask`` (B, 1)."""

    mask: torch.Tensor
    scale: torch.Tensor | float
    keep: torch.Tensor | None
    rows: torch.Tensor | None = None
    _full: torch.Tensor | None = None

    def row_totals(self) -> torch.Tensor:
        if self.rows is None:
            self.rows = self.mask.sum(-1, keepdim=True)
        return self.rows

    def full(self) -> torch.Tensor:
        if self._full is None:
            self._full = self.mask * self.scale if self.keep is None else self.mask * self.scale * self.keep
        return self._full

    def times(self, coef: torch.Tensor) -> torch.Tensor:
        """``E·coef``, (B, T): one pass when ``coef`` is one value per row."""
        if self.keep is None and self._full is None and coef.shape[-1] == 1:
            return self.mask * (self.scale * coef)
        return self.full() * coef

    def row_sums(self) -> torch.Tensor:
        """``Σ_t E``, (B, 1): the weight of a per-row ``ℓ``."""
        if self.keep is None:
            return self.row_totals() * self.scale
        return self.full().sum(-1, keepdim=True)


@dataclass
class ClosedForm:
    """``value = Σ E·ℓ`` (ℓ broadcast over tokens when it is (B, 1)) and its derivatives: ``g_log_w`` w.r.t. the
    level's log-ratio (its shape), ``g_lp`` w.r.t. the log-probs directly, ``g_d`` w.r.t. the token log-ratio."""

    value: torch.Tensor | None
    metrics: dict[str, torch.Tensor]
    g_log_w: torch.Tensor | None = None
    g_lp: torch.Tensor | None = None
    g_d: torch.Tensor | None = None
    linear: bool = False
    """``ℓ`` is linear in ``lp`` with a detached coefficient (``value = Σ g_lp·lp``, no other derivative): the value
    is then left to the caller (``value`` is None), which computes it as that dot product with autograd."""
