"""KL penalty to the reference policy (docs/algorithms.md §4)."""

from __future__ import annotations

import torch

from .importance import LOG_RATIO_CLAMP


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor, d: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k3 estimator of ``KL(π_θ ‖ π_ref)`` (Schulman, "Approximating KL divergence"):

    ``x = clamp(ref - lp, -20, 20)``, ``KL = exp(x) - x - 1`` (≥ 0, unbiased under samples from ``π_θ``).

    With ``d`` (the *token-level* log-ratio ``lp - old``, not detached) the DeepSeek-V3.2 bias correction is
    applied for off-policy samples: ``KL *= exp(clamp(d, -20, 20))``. It stays token level even when the policy
    loss is sequence level (TRL issue #6586 broadcast the sequence ratio here).
    """
    x = torch.clamp(ref_logps.detach() - logps, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = torch.exp(x) - x - 1.0
    if d is not None:
        kl = kl * torch.exp(torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return kl


@torch.no_grad()
def k3_kl_closed_form(
    logps: torch.Tensor, ref_logps: torch.Tensor, d: torch.Tensor | None = None, d_in_range: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`k3_kl` and its derivative w.r.t. ``logps``, without autograd: ``∂KL/∂lp = -(e^x - 1)`` where the
    clamp of ``x`` passes; with ``d`` (bias correction), ``∂(KL·e^d)/∂lp = e^d·(∂KL/∂lp + KL·1[d in range])``
    (``d_in_range``: 1.0 where the clamp of ``d`` passed, 0.0 where it clamped; None means everywhere)."""
    raw = ref_logps.detach() - logps
    x = torch.clamp(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ex = torch.exp(x)
    kl = ex - x - 1.0
    dkl = torch.where(x == raw, 1.0 - ex, 0.0)
    if d is not None:
        w = torch.exp(torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        dkl = (dkl + (kl if d_in_range is None else kl * d_in_range)) * w
        kl = kl * w
    return kl, dkl
