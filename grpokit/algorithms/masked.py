"""Means over the valid (mask = 1) tokens of a (B, T) batch, and statistics that skip NaN (\"not applicable\"): the
reductions every other module uses."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, denom: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid tokens, or over rows when ``x`` is (B, 1) (one value per sequence).
    Detached; 0 when nothing is valid. ``denom``: ``mask.sum().clamp(min=1)`` when already known."""
    if x.requires_grad:
        x = x.detach()
    if x.dtype != mask.dtype:
        x = x.to(mask.dtype)
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.mean() if x.numel() else x.sum()
    denom = mask.sum().clamp(min=1.0) if denom is None else denom
    if x.shape == mask.shape:
        return torch.dot(x.reshape(-1), mask.reshape(-1)) / denom
    return (x.expand_as(mask) * mask).sum() / denom


def masked_row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_t m·x / max(1, Σ_t m)`` per row, shape (B, 1). Empty rows give 0."""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs (NaN where fewer than two values are valid)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True).to(x.dtype)
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (count - 1)
    std = torch.sqrt(var)
    return std if keepdim else std.squeeze(dim)
