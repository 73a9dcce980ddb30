"""Masks that switch parts of the per-token loss off (docs/algorithms.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .masked import masked_row_mean


@torch.no_grad()
def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, (B, 1) of 0/1.

    Keep row ``i`` if ``A_i ≥ 0`` or ``mean_t m·(lp_sampler - sg[lp]) ≤ δ``: negative-advantage sequences that
    drifted too far from the sampler are dropped. Tokens without a sampler log-prob (NaN) count as 0.
    """
    drift = torch.nan_to_num(sampler_logps - logps.detach(), nan=0.0)
    mean_drift = masked_row_mean(drift, mask)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
    return ((adv >= 0) | (mean_drift <= threshold)).to(mask.dtype)


@torch.no_grad()
def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float,
                      gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Keep only the top ``top_quantile`` fraction of tokens by entropy ("forking tokens", arXiv 2506.01939).

    A token is kept if it is valid and its entropy is ≥ the ``(1 - top_quantile)`` quantile of all valid-token
    entropies of the batch. Returns (B, T) of 0/1; all zeros when no token is valid.

    ``gather``: under data parallelism, a function from this rank's valid entropies (1-D) to those of every rank
    (a collective: every rank calls it, even with none), so the threshold is the whole batch's, as on one process.
    """
    valid = mask.bool()
    # Threshold and comparison both in float32: a float64 entropy equal to the quantile (or to it up to the rounding
    # of 1 - top_quantile) is kept, and bf16 entropies are not compared against a bf16-rounded threshold.
    ent = entropies.detach().float()
    values = ent[valid]
    if gather is not None:
        values = gather(values).float()
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return ((ent >= threshold) & valid).to(mask.dtype)
