"""Moving averages of weights: TR-DPO's soft update of the reference (``sync_ref_model``, arXiv 2404.09656) and the
exponential moving average of the trained weights (``ema_decay``, docs/algorithms.md §9). One in-place mix serves
both."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def ema_decay_at(decay: float, updates: int) -> float:
    """The decay of the ``t``-th update (``t ≥ 1``) of ``ema_decay``'s average: ``d_t = min(decay, (1 + t) / (10 + t))``
    (TensorFlow's ``ExponentialMovingAverage(num_updates=t)``: early averages are not dominated by the initial
    weights). The average then moves as ``W̄ ← d_t · W̄ + (1 − d_t) · W``, i.e. :func:`mix_` with ``alpha = 1 − d_t``."""
    return min(decay, (1.0 + updates) / (10.0 + updates))


@torch.no_grad()
def mix_(targets: Iterable[torch.Tensor], sources: Iterable[torch.Tensor], alpha: float) -> None:
    """``target ← alpha · source + (1 − alpha) · target`` for each pair, in place; each target keeps its dtype (the
    source is cast to it). The two sequences pair up in order and must be as long and shaped alike."""
    for target, source in zip(targets, sources, strict=True):
        if target.shape != source.shape:
            raise ValueError(f"cannot mix tensors of different shapes ({tuple(target.shape)} vs {tuple(source.shape)})")
        target.lerp_(source.detach().to(target.dtype), alpha)
