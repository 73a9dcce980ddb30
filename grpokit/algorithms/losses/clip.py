"""The PPO clipped surrogate and the five losses built on it — ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``,
``luspo`` — which differ only in how the per-token terms are aggregated (see ``aggregation.py``)."""

from __future__ import annotations

import torch

from ._common import clip_metrics, clip_metrics_from_counts, dot, inside_clip
from ._context import ClosedForm, LossContext, LossWeights
from ._registry import LossSpec, register_loss


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
    return loss, clip_metrics(low, high, c.mask)


def clipped_rows(k: torch.Tensor, c: LossContext, E: LossWeights) -> torch.Tensor:
    """Per row, the valid tokens past their clip bound: ``Σ_t m·(1 - k)`` (B,); consumes ``k``."""
    if k.shape[-1] == 1 and c.mask.shape[-1] != 1:
        return (1.0 - k).squeeze(-1)
    return E.row_totals().squeeze(-1) - k.mul_(c.mask).sum(-1)


def clipped_surrogate_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`clipped_surrogate_loss`: ``ℓ = -A·r`` where the ratio is inside its clip side, ``-A·bound`` past it
    (no gradient there); ``∂ℓ/∂log w = -A·r`` inside."""
    r = torch.exp(c.log_w)
    per_row = r.shape[-1] == 1 and c.mask.shape[-1] != 1
    lo, hi = 1.0 - c.eps_lo, 1.0 + c.eps_hi
    if c.delta is None:
        k, bound, gap = inside_clip(r, c.A, hi, lo)
        # ℓ = -A·(bound - (bound - r)·k): the value is Σ_i bound_i·Σ_t (-A·E) - Σ (-A·E)·gap·k
        row_weight = E.row_sums() * -c.A
        neg_wa = row_weight if per_row else E.times(-c.A)
        value = (row_weight * bound).sum() - dot(neg_wa, gap.mul_(k))
        g = neg_wa * r.mul_(k) if per_row else neg_wa.mul_(r.mul_(k))
    else:  # two-sided: r₁ = min(r, δ); the min of the two branches, ties split as autograd splits them
        w = E.row_sums() if per_row else E.full()
        r2 = torch.clamp(r, lo, hi)
        r1 = torch.clamp(r, max=c.delta)
        a1, a2 = r1 * c.A, r2 * c.A
        value = -dot(w, torch.min(a1, a2))
        c1 = (r <= c.delta).to(r.dtype)
        c2 = ((r >= lo) & (r <= hi)).to(r.dtype)
        ks = torch.where(a1 < a2, c1, torch.where(a1 > a2, c2, 0.5 * (c1 + c2)))
        g = -(w * c.A) * r * ks
        k = 1.0 - (((r < lo) & (c.A < 0)) | ((r > hi) & (c.A > 0))).to(r.dtype)
    metrics = clip_metrics_from_counts(clipped_rows(k, c, E), c.A, c.mask, per_row, c.mask_denom)
    return ClosedForm(value=value, metrics=metrics, g_log_w=g)


_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
_GSPO = {"epsilon": 3e-4, "epsilon_high": 4e-4}

for _name, _aggregation, _summary, _reference, _recipes in (
    ("grpo", "sequence_mean", "PPO clip; per-sequence mean, then mean over rows",
     "GRPO, DeepSeekMath arXiv 2402.03300",
     {"grpo": {}, "gspo": {"importance_sampling_level": "sequence", **_GSPO},
      "gspo_token": {"importance_sampling_level": "sequence_token", **_GSPO}}),
    ("bnpo", "token_mean", "PPO clip; token mean of each micro-batch",
     "TRL's bnpo (normalised by the local batch's tokens)", {"bnpo": {}}),
    ("dr_grpo", "fixed_length", "PPO clip; sum over a constant B·max_completion_length (no length bias)",
     "Dr. GRPO, arXiv 2503.20783", {"dr_grpo": {"scale_rewards": "none"}}),
    ("dapo", "global_token_mean", "PPO clip with clip-higher; token mean over the whole optimizer step",
     "DAPO, arXiv 2503.14476", {"dapo": {"epsilon_high": 0.28}}),
    ("luspo", "sequence_sum", "PPO clip; length-weighted sequence sums (meant for sequence level)",
     "LUSPO, arXiv 2602.05261", {"luspo": {"importance_sampling_level": "sequence"}}),
):
    register_loss(LossSpec(
        name=_name, summary=_summary, reference=_reference, term=clipped_surrogate_loss,
        closed_form=clipped_surrogate_closed_form, aggregation=_aggregation, epsilon="ratio",
        preferred_level="sequence" if _name == "luspo" else None, metrics=_CLIP_METRICS, recipes=_recipes,
    ))
