"""CISPO: REINFORCE with a clipped, detached importance weight (MiniMax-M1)."""

from __future__ import annotations

import torch

from ..masked import masked_mean
from ._context import ClosedForm, LossContext, LossWeights
from ._registry import LossSpec, register_loss

CISPO_DEFAULT_EPSILON_HIGH = 5.0
"""CISPO's absolute cap on the IS weight when ``epsilon_high`` is unset (ScaleRL's value)."""


def cispo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585 eq. 4): REINFORCE with a clipped, detached IS weight,

    ``ℓ = -sg[min(r, ε_hi)]·A·lp``. ``ε_hi`` is an absolute cap on the weight (not ``1+ε``).
    """
    r = torch.exp(c.log_w)
    weight = torch.clamp(r, max=c.eps_hi).detach()
    loss = -weight * c.A * c.lp
    clipped = (r > c.eps_hi) & (c.A > 0)
    return loss, {"cispo_clip_ratio": masked_mean(clipped, c.mask)}


def cispo_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`cispo_loss`: ``ℓ = -sg[min(r, ε_hi)]·A·lp``, so ``∂ℓ/∂lp = -min(r, ε_hi)·A``."""
    r = torch.exp(c.log_w)
    coef = E.times(torch.clamp(r, max=c.eps_hi) * -c.A)
    clipped = (r > c.eps_hi) & (c.A > 0)
    return ClosedForm(value=None, metrics={"cispo_clip_ratio": masked_mean(clipped, c.mask, c.mask_denom)},
                      g_lp=coef, linear=True)


register_loss(LossSpec(
    name="cispo", summary="REINFORCE with the IS weight capped at epsilon_high and detached",
    reference="MiniMax-M1, arXiv 2506.13585; cap 5.0 from ScaleRL, arXiv 2510.13786",
    term=cispo_loss, closed_form=cispo_closed_form, aggregation="global_token_mean", epsilon="cap",
    default_epsilon_high=CISPO_DEFAULT_EPSILON_HIGH,
    default_epsilon_high_note=(
        f"loss_type='cispo' with epsilon_high unset: capping the IS weight at {CISPO_DEFAULT_EPSILON_HIGH} "
        "(ScaleRL); TRL's default of 0.2 would scale every gradient by 0.2."),
    metrics=("cispo_clip_ratio",), recipes={"cispo": {"epsilon_high": CISPO_DEFAULT_EPSILON_HIGH}},
))
