"""VESPO: REINFORCE on the log-probs scaled by a detached, gamma-shaped weight of the whole sequence's ratio."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..importance import LOG_RATIO_CLAMP
from ._common import where
from ._context import ClosedForm, LossContext, LossWeights
from ._registry import LossSpec, param, register_loss


@dataclass(frozen=True)
class VespoParams:
    k_pos: float = param(2.0, config="vespo_k_pos", help="VESPO shape k for A ≥ 0.", ge=0)
    lambda_pos: float = param(3.0, config="vespo_lambda_pos", help="VESPO rate λ for A ≥ 0.", ge=0)
    k_neg: float = param(3.0, config="vespo_k_neg", help="VESPO shape k for A < 0.", ge=0)
    lambda_neg: float = param(2.0, config="vespo_lambda_neg", help="VESPO rate λ for A < 0.", ge=0)


@torch.no_grad()
def vespo_weights(c: LossContext) -> tuple[torch.Tensor, torch.Tensor]:
    """VESPO's detached sequence weight (arXiv 2602.10693), returns ``(φ, log W)``, each (B, 1).

    ``log W_i = clamp(Σ_t m·d [+ Σ_t m·clamp(log ρ, log 1e-8, 20)], log 1e-8, 20)`` (a *sum*: the true sequence
    ratio), ``φ = exp(λ + k·log W - λ·W) = W^k·e^{λ(1-W)}`` with ``(k, λ)`` by the sign of ``A``; ``φ(1) = 1``.
    """
    phi, log_w, _, _ = _vespo_weights(c)
    return phi, log_w


def _vespo_weights(c: LossContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(φ, log W, W, A ≥ 0)`` of :func:`vespo_weights`; call it without gradient."""
    p: VespoParams = c.params if c.params is not None else VespoParams()
    low = math.log(1e-8)
    seq = torch.linalg.vecdot(c.d, c.mask if c.mask.dtype == c.d.dtype else c.mask.to(c.d.dtype)).unsqueeze(-1)
    if c.sampler_ratio is not None:
        log_rho = torch.log(c.sampler_ratio.to(seq.dtype)).clamp(low, LOG_RATIO_CLAMP)
        seq = seq + (log_rho * c.mask).sum(-1, keepdim=True)
    log_w = seq.clamp(low, LOG_RATIO_CLAMP)
    nonneg = c.A >= 0
    k = where(nonneg, p.k_pos, p.k_neg, log_w)
    # clamping λ to 1e-4 before it becomes a tensor rounds the same way as clamping the tensor
    lam = where(nonneg, max(p.lambda_pos, 1e-4), max(p.lambda_neg, 1e-4), log_w)
    w = torch.exp(log_w)
    phi = torch.exp(torch.addcmul(lam - lam * w, k, log_w))  # λ + k·log W - λ·W
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0), log_w, w, nonneg


def vespo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: ``ℓ = -φ_i·A_i·lp[i,t]`` with the detached gamma-shaped weight ``φ`` of :func:`vespo_weights`.

    On-policy ``φ ≡ 1`` and this is REINFORCE with group advantages.
    """
    with torch.no_grad():
        phi, log_w, w, nonneg = _vespo_weights(c)
        metrics = _vespo_metrics(phi, log_w, w, nonneg)
    loss = -phi * c.A * c.lp
    return loss, metrics


def vespo_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`vespo_loss`: ``ℓ = -φ·A·lp`` with ``φ`` detached, so ``∂ℓ/∂lp = -φ·A``."""
    phi, log_w, w, nonneg = _vespo_weights(c)
    coef = E.times(-phi * c.A)
    return ClosedForm(value=None, metrics=_vespo_metrics(phi, log_w, w, nonneg), g_lp=coef, linear=True)


_VESPO_METRICS = ("vespo/phi_seq_mean", "vespo/w_seq_mean", "vespo/log_w_seq_mean", "vespo/phi_pos_mean",
                  "vespo/phi_neg_mean")


def _vespo_metrics(phi, log_w, w, nonneg) -> dict[str, torch.Tensor]:
    """Means of ``φ``, ``W`` and ``log W`` over rows, and of ``φ`` over the rows with ``A ≥ 0`` and with ``A < 0``
    (0 when there are none). Inputs detached."""
    sel = torch.cat([nonneg, ~nonneg], 1).to(phi.dtype)  # (B, 2): A ≥ 0, A < 0
    by_sign = (phi * sel).sum(0) / sel.sum(0).clamp(min=1.0)
    return dict(zip(_VESPO_METRICS, torch.cat([torch.cat([phi, w, log_w], 1).mean(0), by_sign]).unbind()))


register_loss(LossSpec(
    name="vespo", summary="REINFORCE scaled by the detached sequence weight φ = W^k·e^{λ(1-W)}",
    reference="VESPO, arXiv 2602.10693", term=vespo_loss, closed_form=vespo_closed_form,
    aggregation="global_token_mean", params=VespoParams, epsilon="unused", sampler_ratio="fold",
    levels=("token",), metrics=_VESPO_METRICS, recipes={"vespo": {}},
))
