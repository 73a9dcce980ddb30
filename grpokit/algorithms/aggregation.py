"""Loss aggregation: how per-token losses become one scalar per micro-batch (ALGORITHMS.md §3).

The normalisers are chosen so that summing the returned loss over the micro-batches of one optimizer step
reproduces the loss of the same data taken in one batch on one process (exactly for ``dapo``, ``cispo`` and
``vespo``; for equally sized micro-batches for the per-micro-batch normalisers ``grpo``, ``sapo``, ``gmpo``,
``dr_grpo``, ``luspo``, and for equal token counts for ``bnpo``, which is local by definition).
"""

from __future__ import annotations

import torch

SEQUENCE_MEAN = ("grpo", "sapo", "gmpo")
GLOBAL_TOKEN_MEAN = ("dapo", "cispo", "vespo")
AGGREGATIONS = SEQUENCE_MEAN + GLOBAL_TOKEN_MEAN + ("bnpo", "dr_grpo", "luspo")


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    num_processes: int = 1,
) -> torch.Tensor:
    """Reduce ``ℓ`` (B, T) or (B, 1) to the scalar loss of one micro-batch.

    - ``grpo``/``sapo``/``gmpo``: ``mean_i[Σ_t m·ℓ / max(1, Σ_t m)] / GA`` (sequence mean, then row mean; GRPO).
    - ``bnpo``: ``Σ m·ℓ / max(1, Σ m) / GA`` (token mean of this micro-batch).
    - ``dr_grpo``: ``Σ m·ℓ / (B·L) / GA`` with the constant ``L = max_completion_length`` (Dr. GRPO,
      arXiv 2503.20783: no length bias).
    - ``dapo``/``cispo``/``vespo``: ``Σ m·ℓ / (max(1, N)/P · GA/spg)`` with ``N`` the loss tokens of the whole
      generation batch on all ranks (``num_items_in_batch``; this micro-batch's ``Σ m`` when not given): over
      one optimizer step, the global token mean (DAPO, arXiv 2503.14476 eq. 8).
    - ``luspo``: ``mean_i[Σ_t m·ℓ] / GA`` (length-weighted sequence sum).
    """
    ga = float(gradient_accumulation_steps)
    weighted = per_token_loss * mask if per_token_loss.shape == mask.shape else per_token_loss.expand_as(mask) * mask
    if loss_type in SEQUENCE_MEAN:
        rows = weighted.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return _row_mean(rows) / ga
    if loss_type == "bnpo":
        return weighted.sum() / mask.sum().clamp(min=1.0) / ga
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else mask.shape[-1]
        return weighted.sum() / (max(1, mask.shape[0]) * length) / ga
    if loss_type in GLOBAL_TOKEN_MEAN:
        n = mask.sum() if num_items_in_batch is None else num_items_in_batch
        n = torch.as_tensor(n, dtype=weighted.dtype, device=weighted.device).clamp(min=1.0)
        return weighted.sum() / (n / num_processes * (ga / steps_per_generation))
    if loss_type == "luspo":
        return _row_mean(weighted.sum(-1)) / ga
    raise ValueError(f"loss_type={loss_type!r} has no aggregation; allowed: {', '.join(AGGREGATIONS)}")


def aggregation_scale(
    mask: torch.Tensor,
    loss_type: str,
    *,
    rows: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    num_processes: int = 1,
) -> torch.Tensor | float:
    """The factor ``s`` (per row (B, 1), or one number) with ``aggregate_loss(ℓ) = Σ mask·s·ℓ`` for every ``ℓ``:
    one over the normaliser of :func:`aggregate_loss`. ``rows``: ``mask.sum(-1, keepdim=True)`` when already
    computed. No host sync."""
    ga = float(gradient_accumulation_steps)
    if loss_type in SEQUENCE_MEAN:
        rows = mask.sum(-1, keepdim=True) if rows is None else rows
        return 1.0 / (rows.clamp(min=1.0) * (max(1, mask.shape[0]) * ga))
    if loss_type == "bnpo":
        total = mask.sum() if rows is None else rows.sum()
        return 1.0 / (total.clamp(min=1.0) * ga)
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else mask.shape[-1]
        return 1.0 / ((max(1, mask.shape[0]) * length) * ga)
    if loss_type in GLOBAL_TOKEN_MEAN:
        if num_items_in_batch is None:
            n = mask.sum() if rows is None else rows.sum()
        else:
            n = torch.as_tensor(num_items_in_batch, dtype=mask.dtype, device=mask.device)
        return (num_processes * steps_per_generation / ga) / n.clamp(min=1.0)
    if loss_type == "luspo":
        return 1.0 / (max(1, mask.shape[0]) * ga)
    raise ValueError(f"loss_type={loss_type!r} has no aggregation; allowed: {', '.join(AGGREGATIONS)}")


def aggregation_weights(mask: torch.Tensor, loss_type: str, **kwargs) -> torch.Tensor:
    """The weights ``W = mask·s`` (B, T) with ``aggregate_loss(ℓ) = Σ W·ℓ`` (so ``∂loss/∂ℓ = W``); see
    :func:`aggregation_scale`."""
    return mask * aggregation_scale(mask, loss_type, **kwargs)


def _row_mean(rows: torch.Tensor) -> torch.Tensor:
    # mean over zero rows is NaN in torch; an empty micro-batch contributes 0 instead.
    return rows.mean() if rows.numel() else rows.sum()
