"""Clip-Cov: PPO clipping plus the gradient of a few high-covariance tokens switched off, against entropy collapse."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masked import masked_mean
from ._common import clip_metrics
from ._context import LossContext
from ._registry import LossSpec, param, register_loss


@dataclass(frozen=True)
class ClipCovParams:
    ratio: float = param(2e-4, config="clip_cov_ratio", gt=0, le=1,
                         help="Clip-Cov: fraction of the micro-batch's valid tokens whose gradient is switched off.")
    lb: float = param(1.0, config="clip_cov_lb", help="Clip-Cov: lower bound of the covariance of eligible tokens.")
    ub: float = param(5.0, config="clip_cov_ub", help="Clip-Cov: upper bound of the covariance of eligible tokens.")

    def __post_init__(self) -> None:
        if not self.ub > self.lb:
            raise ValueError(f"clip_cov_ub={self.ub!r} must be larger than clip_cov_lb={self.lb!r}")


@torch.no_grad()
def token_covariance(lp: torch.Tensor, A: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The centred cross term of each valid token, ``Cov_t = (A_i - Ā)·(lp_t - l̄p)`` (B, T), with ``Ā`` and ``l̄p``
    the means over the micro-batch's valid tokens (``A`` broadcast over its row's tokens). Its mean over tokens is
    the covariance of advantage and log-prob that drives the entropy change (arXiv 2505.22617, §3)."""
    a = A.expand_as(lp)
    return (a - masked_mean(a, mask)) * (lp.detach() - masked_mean(lp, mask))


def clip_cov_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv 2505.22617, §4.2; verl's ``clip_cov``):

    ``ℓ = -min(r·A, clip(r, 1-ε_lo, 1+ε_hi)·A)·(1 - c_t)`` where ``c_t = 1`` for a random subset of
    ``max(1, ⌊ratio·N⌋)`` tokens (``N`` valid tokens of the micro-batch) drawn from the valid tokens that PPO did
    not clip and whose covariance :func:`token_covariance` lies strictly between ``lb`` and ``ub``; their
    gradient is switched off. Logs ``clip_cov/clipped_frac`` (the share of valid tokens switched off) and TRL's
    clip ratios of the PPO part.
    """
    p: ClipCovParams = c.params
    r = torch.exp(c.log_w)
    unclipped = -r * c.A
    clipped = -torch.clamp(r, 1.0 - c.eps_lo, 1.0 + c.eps_hi) * c.A
    valid = c.mask.bool()
    with torch.no_grad():
        ppo_clipped = (clipped > unclipped) & valid
        cov = token_covariance(c.lp, c.A, c.mask)
        eligible = (cov > p.lb) & (cov < p.ub) & valid & ~ppo_clipped
        candidates = eligible.reshape(-1).nonzero().squeeze(-1)
        n_pick = min(max(1, int(p.ratio * int(valid.sum()))), candidates.numel())
        pick = torch.randperm(candidates.numel(), generator=c.generator, device="cpu")[:n_pick]
        off = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        off[candidates[pick.to(candidates.device)]] = True
        off = off.view_as(valid)
    loss = torch.where(off, 0.0, torch.maximum(unclipped, clipped))
    metrics = clip_metrics((r < 1.0 - c.eps_lo) & (c.A < 0), (r > 1.0 + c.eps_hi) & (c.A > 0), c.mask)
    metrics["clip_cov/clipped_frac"] = masked_mean(off, c.mask)
    return loss, metrics


register_loss(LossSpec(
    name="clip_cov", summary="PPO clip; the gradient of a few random high-covariance tokens is switched off",
    reference="Clip-Cov, The Entropy Mechanism of RL for Reasoning LMs, arXiv 2505.22617 (verl's clip_cov)",
    term=clip_cov_loss, aggregation="global_token_mean", params=ClipCovParams, epsilon="ratio",
    preferred_level="token", batch_dependent=True,
    metrics=("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_cov/clipped_frac"),
    recipes={"clip_cov": {}}, in_trl=False,
))
