"""Entropy regularisation (TRL's ``entropy_coef``)."""

from __future__ import annotations

import torch


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, coef: float, gradient_accumulation_steps: int = 1) -> torch.Tensor:
    """The term added to the loss: ``-coef · Σ m·H / max(1, Σ m) / GA`` (maximise the mean token entropy ``H``
    of the valid tokens; scaled for gradient accumulation only, whatever the policy loss's normaliser)."""
    mean_h = (entropies * mask).sum() / mask.sum().clamp(min=1.0)
    return -coef * mean_h / gradient_accumulation_steps
