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


def _nan_extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """The min (or max) of the non-NaN entries of ``x``; NaN when there are none."""
    if x.numel() == 0:
        return x.new_tensor(float("nan"))
    valid = ~torch.isnan(x)
    out = torch.where(valid, x, float("-inf") if largest else float("inf"))
    out = out.max() if largest else out.min()
    return torch.where(valid.any(), out, torch.full_like(out, float("nan")))


def _row_extremes(low_rows: torch.Tensor, high_rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/low_min`` and ``clip_ratio/high_max``: over rows, the smallest share of a row's tokens
    clipped below and the largest share clipped above (NaN rows, with no valid token, are left out)."""
    return {"clip_ratio/low_min": _nan_extreme(low_rows, largest=False),
            "clip_ratio/high_max": _nan_extreme(high_rows, largest=True)}


def clip_metrics(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's clip metrics from boolean maps of the tokens (or rows) clipped below (``A < 0``) and above (``A > 0``)."""
    if low.shape[-1] == 1 and mask.shape[-1] != 1:  # one ratio per row: a row is clipped or not
        low_rows, high_rows = low.squeeze(-1).to(mask.dtype), high.squeeze(-1).to(mask.dtype)
    else:
        n = mask.sum(-1)
        low_rows, high_rows = (low.to(mask.dtype) * mask).sum(-1) / n, (high.to(mask.dtype) * mask).sum(-1) / n
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/region_mean": masked_mean(low | high, mask),
        **_row_extremes(low_rows.detach(), high_rows.detach()),
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
    low_rows = torch.where(a < 0, clipped_rows, 0.0)
    high_rows = torch.where(a > 0, clipped_rows, 0.0)
    low, high = low_rows.sum(), high_rows.sum()
    if not per_row:  # shares of each row's tokens
        n = mask.sum(-1)
        low_rows, high_rows = low_rows / n, high_rows / n
    return {"clip_ratio/low_mean": low / denom, "clip_ratio/high_mean": high / denom,
            "clip_ratio/region_mean": (low + high) / denom, **_row_extremes(low_rows, high_rows)}


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
