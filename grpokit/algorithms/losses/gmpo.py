"""GMPO: maximise the geometric mean of the token ratios, clipped in log space."""

from __future__ import annotations

import torch

from ..masked import masked_row_mean
from ._common import clip_metrics, clip_metrics_from_counts, inside_clip
from ._context import ClosedForm, LossContext, LossWeights
from ._registry import LossSpec, register_loss
from .clip import clipped_rows


def gmpo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (arXiv 2507.20673 eq. 4): maximise the geometric mean of token ratios, clipped in log space.

    ``d* = sgn(A)·min(sgn(A)·d, sgn(A)·clip(d, -ε_lo, ε_hi))``, ``ℓ_i = -A_i·exp(Σ_t m·d* / max(1, Σ_t m))``,
    one value per row (B, 1). Always built from token-level ratios, whatever the level setting.
    """
    sign = torch.sign(c.A)
    clipped = torch.clamp(c.d, -c.eps_lo, c.eps_hi)
    d_star = sign * torch.min(sign * c.d, sign * clipped)
    mean_log = masked_row_mean(d_star, c.mask)
    loss = -c.A * torch.exp(mean_log)
    low = (c.d < -c.eps_lo) & (c.A < 0)
    high = (c.d > c.eps_hi) & (c.A > 0)
    return loss, clip_metrics(low, high, c.mask)


def gmpo_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`gmpo_loss`: ``ℓ_i = -A_i·exp(mean_t m·d*)``; ``∂ℓ_i/∂d_t = ℓ_i·m_t/|o_i|`` where ``d`` is inside
    its clip side, 0 past it."""
    k, bound, gap = inside_clip(c.d, c.A, c.eps_hi, -c.eps_lo)
    d_star = bound - gap.mul_(k)  # d inside, the bound past it
    n = E.row_totals().clamp(min=1.0)
    mean_log = torch.linalg.vecdot(d_star, c.mask).unsqueeze(-1) / n
    loss = -c.A * torch.exp(mean_log)
    e = E.row_sums()
    value = (e * loss).sum()
    g = E.mask * (e * loss / n)
    g.mul_(k)
    metrics = clip_metrics_from_counts(clipped_rows(k, c, E), c.A, c.mask, False, c.mask_denom)
    return ClosedForm(value=value, metrics=metrics, g_d=g)


register_loss(LossSpec(
    name="gmpo", summary="geometric mean of token ratios, clipped in log space; one term per sequence",
    reference="GMPO, arXiv 2507.20673", term=gmpo_loss, closed_form=gmpo_closed_form, aggregation="sequence_mean",
    epsilon="log_ratio", levels=("token",),
    metrics=("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"),
    recipes={"gmpo": {"epsilon": 0.4, "epsilon_high": 0.4}}, in_trl=False,
))
