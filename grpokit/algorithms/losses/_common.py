"""Small tensor helpers the per-token losses share: hyper-parameters as cached 0-dim tensors, and the clip
bookkeeping of the clipped losses. No loss is defined here."""

from __future__ import annotations

import torch

from ..masked import masked_mean

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor holding ``value`` in ``like``'s dtype and device, made once (hyper-parameters recur on
    every call)."""
    key = (value, like.dtype, like.device)
    out = _CONSTANTS.get(key)
    if out is None:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        with torch.inference_mode(False), torch.no_grad():
            out = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return out


def where(cond: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """``torch.where`` of two hyper-parameters in ``like``'s dtype (python floats would pass through float32)."""
    return torch.where(cond, constant(if_true, like), constant(if_false, like))


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ a·b`` of two broadcastable tensors, in one pass when they have the same shape."""
    if a.shape == b.shape:
        return torch.dot(a.reshape(-1), b.reshape(-1))
    return (a * b).sum()


def clip_metrics(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's clip metrics from boolean maps of the tokens (or rows) clipped below (``A < 0``) and above (``A > 0``)."""
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/region_mean": masked_mean(low | high, mask),
    }


def clip_metrics_from_counts(clipped_rows: torch.Tensor, A: torch.Tensor, mask: torch.Tensor, per_row: bool,
                             mask_denom: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The same metrics from the clipped count of each row (B,): low = rows with ``A < 0``, high = with ``A > 0``;
    means over tokens, or over rows when the ratio is one value per row."""
    if per_row:
        denom = float(max(1, clipped_rows.numel()))
    else:
        denom = mask_denom if mask_denom is not None else mask.sum().clamp(min=1.0)
    a = A.squeeze(-1)
    low = torch.where(a < 0, clipped_rows, 0.0).sum()
    high = torch.where(a > 0, clipped_rows, 0.0).sum()
    return {"clip_ratio/low_mean": low / denom, "clip_ratio/high_mean": high / denom,
            "clip_ratio/region_mean": (low + high) / denom}


def inside_clip(x: torch.Tensor, A: torch.Tensor, high: float, low: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, bound, bound - x)``: ``bound`` is the clip bound on the side of ``A`` (``high`` if ``A > 0``, else
    ``low``), per row; ``k`` is 1.0 where ``x`` is inside it (``x ≤ high`` if ``A > 0``, ``x ≥ low`` if ``A < 0``,
    the bound itself included; everywhere if ``A = 0``) and 0.0 past it. Float arithmetic only: comparisons and
    ``where`` on (B, T) bool tensors are several times slower on CPU."""
    bound = where(A > 0, high, low, x)
    gap = bound - x
    k = torch.heaviside(gap * torch.sign(A), constant(1.0, x))
    return k, bound, gap
