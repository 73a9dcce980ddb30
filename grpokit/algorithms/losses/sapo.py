"""SAPO: a soft sigmoid gate on the ratio instead of a hard clip."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import dot, where
from ._context import ClosedForm, LossContext, LossWeights
from ._registry import LossSpec, param, register_loss


@dataclass(frozen=True)
class SapoParams:
    temperature_pos: float = param(1.0, config="sapo_temperature_pos", help="SAPO gate temperature for A > 0.",
                                   gt=0)
    temperature_neg: float = param(1.05, config="sapo_temperature_neg", help="SAPO gate temperature for A ≤ 0.",
                                   gt=0)


def sapo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (arXiv 2511.20347): a soft sigmoid gate instead of a hard clip,

    ``ℓ = -σ(τ(r-1))·(4/τ)·A`` with ``τ = τ_pos`` if ``A > 0`` else ``τ_neg``; at ``r = 1`` the gradient equals
    the unclipped surrogate's, and it decays smoothly as ``r`` leaves 1.
    """
    p: SapoParams = c.params
    r = torch.exp(c.log_w)
    tau = where(c.A > 0, p.temperature_pos, p.temperature_neg, r)
    loss = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * c.A
    return loss, {}


def sapo_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`sapo_loss`: ``ℓ = -σ(τ(r-1))·(4/τ)·A``, ``∂ℓ/∂log w = -(4/τ)·A·σ(1-σ)·τ·r``."""
    p: SapoParams = c.params
    r = torch.exp(c.log_w)
    tau = where(c.A > 0, p.temperature_pos, p.temperature_neg, r)
    sig = torch.sigmoid(tau * (r - 1.0))
    per_row = r.shape[-1] == 1 and c.mask.shape[-1] != 1
    coef = E.row_sums() * (-(4.0 / tau) * c.A) if per_row else E.times(-(4.0 / tau) * c.A)
    value = dot(coef, sig)
    g = coef * (sig * (1.0 - sig) * tau * r)
    return ClosedForm(value=value, metrics={}, g_log_w=g)


register_loss(LossSpec(
    name="sapo", summary="soft sigmoid gate σ(τ(r-1))·4/τ instead of a hard clip",
    reference="SAPO, arXiv 2511.20347", term=sapo_loss, closed_form=sapo_closed_form,
    aggregation="sequence_mean", params=SapoParams, epsilon="unused", recipes={"sapo": {}},
))
