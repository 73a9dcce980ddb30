"""KL-Cov: the unclipped surrogate plus a |log-ratio| penalty on the highest-covariance tokens, against entropy
collapse."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masked import masked_mean
from ._context import LossContext
from ._registry import LossSpec, param, register_loss
from .clip_cov import token_covariance


@dataclass(frozen=True)
class KlCovParams:
    ratio: float = param(2e-4, config="kl_cov_ratio", gt=0, le=1,
                         help="KL-Cov: fraction of the micro-batch's valid tokens (highest covariance) penalised.")
    coef: float = param(1.0, config="kl_cov_coef", ge=0,
                        help="KL-Cov: coefficient of the |log-ratio| penalty on those tokens.")


def kl_cov_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al., arXiv 2505.22617, §4.2; verl's ``kl_cov``):

    ``ℓ = -r·A + coef·|d|·s_t`` with no clipping, where ``s_t = 1`` for the ``max(1, ⌊ratio·N⌋)`` valid tokens of the
    micro-batch with the largest covariance :func:`grpokit.algorithms.losses.clip_cov.token_covariance` (``N``
    valid tokens) and ``d = lp - old`` the token log-ratio. Logs ``kl_cov/penalised_frac`` and
    ``kl_cov/abs_log_ratio_mean`` (the mean ``|d|`` over valid tokens).
    """
    p: KlCovParams = c.params
    r = torch.exp(c.log_w)
    abs_d = c.d.abs()
    valid = c.mask.bool()
    with torch.no_grad():
        cov = token_covariance(c.lp, c.A, c.mask).masked_fill(~valid, float("-inf"))
        n_valid = int(valid.sum())
        chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        if n_valid:
            top = torch.topk(cov.reshape(-1), max(1, int(n_valid * p.ratio))).indices
            chosen[top] = True
        chosen = chosen.view_as(valid)
    loss = -r * c.A + (p.coef * abs_d) * chosen.to(abs_d.dtype)
    metrics = {"kl_cov/penalised_frac": masked_mean(chosen, c.mask),
               "kl_cov/abs_log_ratio_mean": masked_mean(abs_d, c.mask)}
    return loss, metrics


register_loss(LossSpec(
    name="kl_cov", summary="unclipped surrogate; a |log-ratio| penalty on the highest-covariance tokens",
    reference="KL-Cov, The Entropy Mechanism of RL for Reasoning LMs, arXiv 2505.22617 (verl's kl_cov)",
    term=kl_cov_loss, aggregation="global_token_mean", params=KlCovParams, epsilon="unused",
    preferred_level="token", batch_dependent=True, metrics=("kl_cov/penalised_frac", "kl_cov/abs_log_ratio_mean"),
    recipes={"kl_cov": {}}, in_trl=False,
))
