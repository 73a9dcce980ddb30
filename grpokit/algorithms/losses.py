"""Per-token policy losses ``ℓ[i,t]`` of the GRPO family, one function each, in a registry
(ALGORITHMS.md §2).

Every loss takes a :class:`LossContext` and returns ``(ℓ, metrics)``. ``ℓ`` is (B, T) or (B, 1) (one value per
row, broadcast over its tokens by the aggregation); ``metrics`` holds detached 0-dim tensors (no host sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .importance import LOG_RATIO_CLAMP


@dataclass
class LossContext:
    """What a per-token loss may read. ``A`` is (B, 1); ``log_w`` is the level's log-ratio (B, T) or (B, 1);
    ``d`` is always the token-level log-ratio (B, T); ``lp`` the current log-probs (grad flows)."""

    lp: torch.Tensor
    d: torch.Tensor
    log_w: torch.Tensor
    A: torch.Tensor
    mask: torch.Tensor
    eps_lo: float
    eps_hi: float
    delta: float | None = None
    sampler_ratio: torch.Tensor | None = None
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    mask_denom: torch.Tensor | None = None
    """``max(1, Σ mask)`` when already computed (saves a pass)."""


LossFn = Callable[[LossContext], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
LOSSES: dict[str, LossFn] = {}


def _registrar(table: dict) -> Callable:
    """A decorator factory that stores the decorated function in ``table`` under each name given."""

    def register(*names: str) -> Callable:
        def wrap(fn):
            for name in names:
                table[name] = fn
            return fn

        return wrap

    return register


register_loss = _registrar(LOSSES)
"""Register a per-token loss under one or more ``loss_type`` names: ``@register_loss("dapo", "grpo")``."""


def masked_mean(x: torch.Tensor, mask: torch.Tensor, denom: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid tokens, or over rows when ``x`` is (B, 1) (one value per sequence).
    Detached; 0 when nothing is valid. ``denom``: ``mask.sum().clamp(min=1)`` when already known."""
    if x.requires_grad:
        x = x.detach()
    if x.dtype != mask.dtype:
        x = x.to(mask.dtype)
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.mean() if x.numel() else x.sum()
    denom = mask.sum().clamp(min=1.0) if denom is None else denom
    if x.shape == mask.shape:
        return torch.dot(x.reshape(-1), mask.reshape(-1)) / denom
    return (x.expand_as(mask) * mask).sum() / denom


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor holding ``value`` in ``like``'s dtype and device, made once (hyper-parameters recur on
    every call)."""
    key = (value, like.dtype, like.device)
    out = _CONSTANTS.get(key)
    if out is None:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        with torch.inference_mode(False), torch.no_grad():
            out = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return out


def _where(cond: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """``torch.where`` of two hyper-parameters in ``like``'s dtype (python floats would pass through float32)."""
    return torch.where(cond, _constant(if_true, like), _constant(if_false, like))


def _clip_metrics(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/region_mean": masked_mean(low | high, mask),
    }


@register_loss("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
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
    return loss, _clip_metrics(low, high, c.mask)


@register_loss("cispo")
def cispo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585 eq. 4): REINFORCE with a clipped, detached IS weight,

    ``ℓ = -sg[min(r, ε_hi)]·A·lp``. ``ε_hi`` is an absolute cap on the weight (not ``1+ε``).
    """
    r = torch.exp(c.log_w)
    weight = torch.clamp(r, max=c.eps_hi).detach()
    loss = -weight * c.A * c.lp
    clipped = (r > c.eps_hi) & (c.A > 0)
    return loss, {"cispo_clip_ratio": masked_mean(clipped, c.mask)}


@register_loss("sapo")
def sapo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (arXiv 2511.20347): a soft sigmoid gate instead of a hard clip,

    ``ℓ = -σ(τ(r-1))·(4/τ)·A`` with ``τ = τ_pos`` if ``A > 0`` else ``τ_neg``; at ``r = 1`` the gradient equals
    the unclipped surrogate's, and it decays smoothly as ``r`` leaves 1.
    """
    r = torch.exp(c.log_w)
    tau = _where(c.A > 0, c.sapo_temperature_pos, c.sapo_temperature_neg, r)
    loss = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * c.A
    return loss, {}


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
    low = math.log(1e-8)
    seq = torch.linalg.vecdot(c.d, c.mask if c.mask.dtype == c.d.dtype else c.mask.to(c.d.dtype)).unsqueeze(-1)
    if c.sampler_ratio is not None:
        log_rho = torch.log(c.sampler_ratio.to(seq.dtype)).clamp(low, LOG_RATIO_CLAMP)
        seq = seq + (log_rho * c.mask).sum(-1, keepdim=True)
    log_w = seq.clamp(low, LOG_RATIO_CLAMP)
    nonneg = c.A >= 0
    k = _where(nonneg, c.vespo_k_pos, c.vespo_k_neg, log_w)
    # clamping λ to 1e-4 before it becomes a tensor rounds the same way as clamping the tensor
    lam = _where(nonneg, max(c.vespo_lambda_pos, 1e-4), max(c.vespo_lambda_neg, 1e-4), log_w)
    w = torch.exp(log_w)
    phi = torch.exp(torch.addcmul(lam - lam * w, k, log_w))  # λ + k·log W - λ·W
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0), log_w, w, nonneg


@register_loss("vespo")
def vespo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: ``ℓ = -φ_i·A_i·lp[i,t]`` with the detached gamma-shaped weight ``φ`` of :func:`vespo_weights`.

    On-policy ``φ ≡ 1`` and this is REINFORCE with group advantages.
    """
    with torch.no_grad():
        phi, log_w, w, nonneg = _vespo_weights(c)
        metrics = _vespo_metrics(phi, log_w, w, nonneg)
    loss = -phi * c.A * c.lp
    return loss, metrics


_VESPO_METRICS = ("vespo/phi_seq_mean", "vespo/w_seq_mean", "vespo/log_w_seq_mean", "vespo/phi_pos_mean",
                  "vespo/phi_neg_mean")


def _vespo_metrics(phi, log_w, w, nonneg) -> dict[str, torch.Tensor]:
    """Means of ``φ``, ``W`` and ``log W`` over rows, and of ``φ`` over the rows with ``A ≥ 0`` and with ``A < 0``
    (0 when there are none). Inputs detached."""
    sel = torch.cat([nonneg, ~nonneg], 1).to(phi.dtype)  # (B, 2): A ≥ 0, A < 0
    by_sign = (phi * sel).sum(0) / sel.sum(0).clamp(min=1.0)
    return dict(zip(_VESPO_METRICS, torch.cat([torch.cat([phi, w, log_w], 1).mean(0), by_sign]).unbind()))


@register_loss("gmpo")
def gmpo_loss(c: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (arXiv 2507.20673 eq. 4): maximise the geometric mean of token ratios, clipped in log space.

    ``d* = sgn(A)·min(sgn(A)·d, sgn(A)·clip(d, -ε_lo, ε_hi))``, ``ℓ_i = -A_i·exp(Σ_t m·d* / max(1, Σ_t m))``,
    one value per row (B, 1). Always built from token-level ratios, whatever the level setting.
    """
    sign = torch.sign(c.A)
    clipped = torch.clamp(c.d, -c.eps_lo, c.eps_hi)
    d_star = sign * torch.min(sign * c.d, sign * clipped)
    mean_log = (d_star * c.mask).sum(-1, keepdim=True) / c.mask.sum(-1, keepdim=True).clamp(min=1.0)
    loss = -c.A * torch.exp(mean_log)
    low = (c.d < -c.eps_lo) & (c.A < 0)
    high = (c.d > c.eps_hi) & (c.A > 0)
    return loss, _clip_metrics(low, high, c.mask)


LOSS_TYPES = tuple(LOSSES)


# -- closed forms: value and gradient together ---------------------------------------------------------------------
# The functions above are the definition, differentiated by autograd. For the built-in losses, `policy_loss` uses
# the closed forms below instead: each returns the weighted value Σ E·ℓ and its partial derivatives, computed
# without building a graph, in a handful of passes over (B, T) (tests/algorithms checks both against each other).


@dataclass
class LossWeights:
    """``E = ∂loss/∂ℓ = mask·scale·keep`` (B, T), kept in factors: ``scale`` is the aggregation's one over its
    normaliser, per row (B, 1) or one number; ``keep`` the detached multipliers of ``ℓ`` (masks, sampler ratio)
    or None; ``rows`` is ``Σ_t mask`` (B, 1)."""

    mask: torch.Tensor
    scale: torch.Tensor | float
    keep: torch.Tensor | None
    rows: torch.Tensor | None = None
    _full: torch.Tensor | None = None

    def row_totals(self) -> torch.Tensor:
        if self.rows is None:
            self.rows = self.mask.sum(-1, keepdim=True)
        return self.rows

    def full(self) -> torch.Tensor:
        if self._full is None:
            self._full = self.mask * self.scale if self.keep is None else self.mask * self.scale * self.keep
        return self._full

    def times(self, coef: torch.Tensor) -> torch.Tensor:
        """``E·coef``, (B, T): one pass when ``coef`` is one value per row."""
        if self.keep is None and self._full is None and coef.shape[-1] == 1:
            return self.mask * (self.scale * coef)
        return self.full() * coef

    def row_sums(self) -> torch.Tensor:
        """``Σ_t E``, (B, 1): the weight of a per-row ``ℓ``."""
        if self.keep is None:
            return self.row_totals() * self.scale
        return self.full().sum(-1, keepdim=True)


@dataclass
class ClosedForm:
    """``value = Σ E·ℓ`` (ℓ broadcast over tokens when it is (B, 1)) and its derivatives: ``g_log_w`` w.r.t. the
    level's log-ratio (its shape), ``g_lp`` w.r.t. the log-probs directly, ``g_d`` w.r.t. the token log-ratio."""

    value: torch.Tensor | None
    metrics: dict[str, torch.Tensor]
    g_log_w: torch.Tensor | None = None
    g_lp: torch.Tensor | None = None
    g_d: torch.Tensor | None = None
    linear: bool = False
    """``ℓ`` is linear in ``lp`` with a detached coefficient (``value = Σ g_lp·lp``, no other derivative): the value
    is then left to the caller (``value`` is None), which computes it as that dot product with autograd."""


ClosedFormFn = Callable[[LossContext, LossWeights], ClosedForm]
CLOSED_FORMS: dict[str, ClosedFormFn] = {}


register_closed_form = _registrar(CLOSED_FORMS)
"""Register the closed form (value and gradient, no autograd) of a registered loss."""


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ a·b`` of two broadcastable tensors, in one pass when they have the same shape."""
    if a.shape == b.shape:
        return torch.dot(a.reshape(-1), b.reshape(-1))
    return (a * b).sum()


def _clip_metrics_closed(clipped_rows: torch.Tensor, c: LossContext, per_row: bool) -> dict[str, torch.Tensor]:
    """TRL's clip metrics from the clipped count of each row (B,): low = rows with ``A < 0``, high = with
    ``A > 0``; means over tokens, or over rows when the ratio is one value per row."""
    if per_row:
        denom = float(max(1, clipped_rows.numel()))
    else:
        denom = c.mask_denom if c.mask_denom is not None else c.mask.sum().clamp(min=1.0)
    a = c.A.squeeze(-1)
    low = torch.where(a < 0, clipped_rows, 0.0).sum()
    high = torch.where(a > 0, clipped_rows, 0.0).sum()
    return {"clip_ratio/low_mean": low / denom, "clip_ratio/high_mean": high / denom,
            "clip_ratio/region_mean": (low + high) / denom}


def _inside(
    x: torch.Tensor, A: torch.Tensor, high: float, low: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k, bound, bound - x)``: ``bound`` is the clip bound on the side of ``A`` (``high`` if ``A > 0``, else
    ``low``), per row; ``k`` is 1.0 where ``x`` is inside it (``x ≤ high`` if ``A > 0``, ``x ≥ low`` if ``A < 0``,
    the bound itself included; everywhere if ``A = 0``) and 0.0 past it. Float arithmetic only: comparisons and
    ``where`` on (B, T) bool tensors are several times slower on CPU."""
    bound = _where(A > 0, high, low, x)
    gap = bound - x
    k = torch.heaviside(gap * torch.sign(A), _constant(1.0, x))
    return k, bound, gap


def _clipped_rows(k: torch.Tensor, c: LossContext, E: LossWeights) -> torch.Tensor:
    """Per row, the valid tokens past their clip bound: ``Σ_t m·(1 - k)`` (B,); consumes ``k``."""
    if k.shape[-1] == 1 and c.mask.shape[-1] != 1:
        return (1.0 - k).squeeze(-1)
    return E.row_totals().squeeze(-1) - k.mul_(c.mask).sum(-1)


@register_closed_form("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
def clipped_surrogate_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`clipped_surrogate_loss`: ``ℓ = -A·r`` where the ratio is inside its clip side, ``-A·bound`` past it
    (no gradient there); ``∂ℓ/∂log w = -A·r`` inside."""
    r = torch.exp(c.log_w)
    per_row = r.shape[-1] == 1 and c.mask.shape[-1] != 1
    lo, hi = 1.0 - c.eps_lo, 1.0 + c.eps_hi
    if c.delta is None:
        k, bound, gap = _inside(r, c.A, hi, lo)
        # ℓ = -A·(bound - (bound - r)·k): the value is Σ_i bound_i·Σ_t (-A·E) - Σ (-A·E)·gap·k
        row_weight = E.row_sums() * -c.A
        neg_wa = row_weight if per_row else E.times(-c.A)
        value = (row_weight * bound).sum() - _dot(neg_wa, gap.mul_(k))
        g = neg_wa * r.mul_(k) if per_row else neg_wa.mul_(r.mul_(k))
    else:  # two-sided: r₁ = min(r, δ); the min of the two branches, ties split as autograd splits them
        w = E.row_sums() if per_row else E.full()
        r2 = torch.clamp(r, lo, hi)
        r1 = torch.clamp(r, max=c.delta)
        a1, a2 = r1 * c.A, r2 * c.A
        value = -_dot(w, torch.min(a1, a2))
        c1 = (r <= c.delta).to(r.dtype)
        c2 = ((r >= lo) & (r <= hi)).to(r.dtype)
        ks = torch.where(a1 < a2, c1, torch.where(a1 > a2, c2, 0.5 * (c1 + c2)))
        g = -(w * c.A) * r * ks
        k = 1.0 - (((r < lo) & (c.A < 0)) | ((r > hi) & (c.A > 0))).to(r.dtype)
    return ClosedForm(value=value, metrics=_clip_metrics_closed(_clipped_rows(k, c, E), c, per_row), g_log_w=g)


@register_closed_form("cispo")
def cispo_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`cispo_loss`: ``ℓ = -sg[min(r, ε_hi)]·A·lp``, so ``∂ℓ/∂lp = -min(r, ε_hi)·A``."""
    r = torch.exp(c.log_w)
    coef = E.times(torch.clamp(r, max=c.eps_hi) * -c.A)
    clipped = (r > c.eps_hi) & (c.A > 0)
    return ClosedForm(value=None, metrics={"cispo_clip_ratio": masked_mean(clipped, c.mask, c.mask_denom)},
                      g_lp=coef, linear=True)


@register_closed_form("sapo")
def sapo_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`sapo_loss`: ``ℓ = -σ(τ(r-1))·(4/τ)·A``, ``∂ℓ/∂log w = -(4/τ)·A·σ(1-σ)·τ·r``."""
    r = torch.exp(c.log_w)
    tau = _where(c.A > 0, c.sapo_temperature_pos, c.sapo_temperature_neg, r)
    sig = torch.sigmoid(tau * (r - 1.0))
    per_row = r.shape[-1] == 1 and c.mask.shape[-1] != 1
    coef = E.row_sums() * (-(4.0 / tau) * c.A) if per_row else E.times(-(4.0 / tau) * c.A)
    value = _dot(coef, sig)
    g = coef * (sig * (1.0 - sig) * tau * r)
    return ClosedForm(value=value, metrics={}, g_log_w=g)


@register_closed_form("vespo")
def vespo_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`vespo_loss`: ``ℓ = -φ·A·lp`` with ``φ`` detached, so ``∂ℓ/∂lp = -φ·A``."""
    phi, log_w, w, nonneg = _vespo_weights(c)
    coef = E.times(-phi * c.A)
    return ClosedForm(value=None, metrics=_vespo_metrics(phi, log_w, w, nonneg), g_lp=coef, linear=True)


@register_closed_form("gmpo")
def gmpo_closed_form(c: LossContext, E: LossWeights) -> ClosedForm:
    """:func:`gmpo_loss`: ``ℓ_i = -A_i·exp(mean_t m·d*)``; ``∂ℓ_i/∂d_t = ℓ_i·m_t/|o_i|`` where ``d`` is inside
    its clip side, 0 past it."""
    k, bound, gap = _inside(c.d, c.A, c.eps_hi, -c.eps_lo)
    d_star = bound - gap.mul_(k)  # d inside, the bound past it
    n = E.row_totals().clamp(min=1.0)
    mean_log = torch.linalg.vecdot(d_star, c.mask).unsqueeze(-1) / n
    loss = -c.A * torch.exp(mean_log)
    e = E.row_sums()
    value = (e * loss).sum()
    g = E.mask * (e * loss / n)
    g.mul_(k)
    return ClosedForm(value=value, metrics=_clip_metrics_closed(_clipped_rows(k, c, E), c, False), g_d=g)
