"""Loss aggregation: how per-token losses become one scalar per micro-batch (docs/algorithms.md, "Aggregation").

Each loss names one aggregation (its ``LossSpec.aggregation``). The normalisers are chosen so that summing the
returned loss over the micro-batches of one optimizer step reproduces the loss of the same data taken in one batch
on one process (exactly for ``global_token_mean``; for equally sized micro-batches for ``sequence_mean``,
``fixed_length`` and ``sequence_sum``; for equal token counts for ``token_mean``, which is local by definition).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = {
    "sequence_mean": "mean_i[Σ_t m·ℓ / max(1, Σ_t m)] / GA",
    "token_mean": "Σ m·ℓ / max(1, Σ m) / GA",
    "fixed_length": "Σ m·ℓ / (B·L) / GA",
    "global_token_mean": "Σ m·ℓ / (max(1, N)/P · GA/spg)",
    "sequence_sum": "mean_i[Σ_t m·ℓ] / GA",
}
"""Every aggregation with its formula (``GA`` gradient-accumulation steps of the optimizer step, ``L``
``max_completion_length``, ``N`` loss tokens of the whole generation batch on all ranks, ``P`` processes, ``spg``
``steps_per_generation``)."""

TOKEN_SUMMED = ("token_mean", "fixed_length", "global_token_mean")
"""Aggregations that sum per-token terms, so a sequence-level ratio weights each sequence by its length."""


@dataclass(frozen=True)
class LossScale:
    """Where a micro-batch stands in its optimizer step: what the normalisers of :data:`AGGREGATIONS` need."""

    max_completion_length: int | None = None
    """``L`` of ``fixed_length`` (default: the padded completion length of the micro-batch)."""
    num_items_in_batch: float | torch.Tensor | None = None
    """``N`` of ``global_token_mean`` (default: this micro-batch's loss tokens)."""
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1
    num_processes: int = 1


def _kind(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r} is not supported; allowed: {', '.join(AGGREGATIONS)} "
                         "(a loss's aggregation is LOSSES[loss_type].aggregation)")
    return aggregation


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, aggregation: str,
                   scale: LossScale | None = None, **scale_fields) -> torch.Tensor:
    """Reduce ``ℓ`` (B, T) or (B, 1) to the scalar loss of one micro-batch (``aggregation``: a key of
    :data:`AGGREGATIONS`; ``scale`` or its fields as keywords):

    - ``sequence_mean`` (GRPO): ``mean_i[Σ_t m·ℓ / max(1, Σ_t m)] / GA``.
    - ``token_mean`` (BNPO): ``Σ m·ℓ / max(1, Σ m) / GA``, the token mean of this micro-batch.
    - ``fixed_length`` (Dr. GRPO, arXiv 2503.20783): ``Σ m·ℓ / (B·L) / GA`` with the constant ``L``: no length bias.
    - ``global_token_mean`` (DAPO, arXiv 2503.14476 eq. 8): ``Σ m·ℓ / (max(1, N)/P · GA/spg)``: over one optimizer
      step, the token mean of the whole generation batch on all ranks.
    - ``sequence_sum`` (LUSPO): ``mean_i[Σ_t m·ℓ] / GA``, length-weighted sequence sums.
    """
    s = aggregation_scale(mask, aggregation, scale, **scale_fields)
    weighted = per_token_loss * mask if per_token_loss.shape == mask.shape else per_token_loss.expand_as(mask) * mask
    if isinstance(s, torch.Tensor) and s.dim() == 2:  # per row
        return (weighted.sum(-1, keepdim=True) * s).sum()
    return weighted.sum() * s


def aggregation_scale(mask: torch.Tensor, aggregation: str, scale: LossScale | None = None, *,
                      rows: torch.Tensor | None = None, **scale_fields) -> torch.Tensor | float:
    """The factor ``s`` (per row (B, 1), or one number) with ``aggregate_loss(ℓ) = Σ mask·s·ℓ`` for every ``ℓ``:
    one over the normaliser. ``rows``: ``mask.sum(-1, keepdim=True)`` when already computed. No host sync."""
    kind = _kind(aggregation)
    sc = scale if scale is not None else LossScale(**scale_fields)
    ga = float(sc.gradient_accumulation_steps)
    b = max(1, mask.shape[0])
    if kind == "sequence_mean":
        rows = mask.sum(-1, keepdim=True) if rows is None else rows
        return 1.0 / (rows.clamp(min=1.0) * (b * ga))
    if kind == "token_mean":
        total = mask.sum() if rows is None else rows.sum()
        return 1.0 / (total.clamp(min=1.0) * ga)
    if kind == "fixed_length":
        length = sc.max_completion_length if sc.max_completion_length is not None else mask.shape[-1]
        return 1.0 / ((b * length) * ga)
    if kind == "global_token_mean":
        if sc.num_items_in_batch is None:
            n = mask.sum() if rows is None else rows.sum()
        else:
            n = torch.as_tensor(sc.num_items_in_batch, dtype=mask.dtype, device=mask.device)
        return (sc.num_processes * sc.steps_per_generation / ga) / n.clamp(min=1.0)
    return 1.0 / (b * ga)  # sequence_sum


def aggregation_weights(mask: torch.Tensor, aggregation: str, scale: LossScale | None = None,
                        **scale_fields) -> torch.Tensor:
    """The weights ``W = mask·s`` (B, T) with ``aggregate_loss(ℓ) = Σ W·ℓ`` (so ``∂loss/∂ℓ = W``); see
    :func:`aggregation_scale`."""
    return mask * aggregation_scale(mask, aggregation, scale, **scale_fields)
