"""``policy_loss``: the one entry point of the loss math (docs/algorithms.md).

Order of operations, per micro-batch:
1. token log-ratio ``d = clamp(lp - old, -20, 20)``; the level's log weight;
2. the per-token loss of ``settings.loss_type`` from the registry (:mod:`.losses`);
3. detached multipliers of ``ℓ``: off-policy sequence mask, high-entropy mask, the sampler ratio ``ρ`` (unless the
   loss folds ``ρ`` into its own weight);
4. ``+ β·KL``;
5. aggregation to a scalar (:mod:`.aggregation`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .aggregation import LossScale, aggregate_loss, aggregation_scale
from .importance import LOG_RATIO_CLAMP, log_importance_weights, token_log_ratio
from .kl import k3_kl, k3_kl_closed_form
from .losses import LossContext, LossSpec, LossWeights
from .losses._common import constant
from .masked import masked_mean
from .masks import high_entropy_mask, off_policy_sequence_mask
from .settings import LossSettings, resolve_epsilon_high

__all__ = ["PolicyLossOutput", "policy_loss", "resolve_epsilon_high"]

ENGINES = ("auto", "autograd", "closed_form")
_SCALE_FIELDS = {f.name for f in dataclasses.fields(LossScale)}


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar, differentiable w.r.t. ``logps``."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached 0-dim tensors (means over this micro-batch), named as TRL logs them."""


@dataclass
class _Inputs:
    """The tensors of one call, checked and in the loss dtype."""

    lp: torch.Tensor
    old: torch.Tensor | None
    A: torch.Tensor
    mask: torch.Tensor
    ref: torch.Tensor | None
    sampler_ratio: torch.Tensor | None
    sampler_logps: torch.Tensor | None
    entropies: torch.Tensor | None


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings | str | None = None,
    *,
    scale: LossScale | None = None,
    ref_logps: torch.Tensor | None = None,
    sampler_ratio: torch.Tensor | None = None,
    sampler_logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    entropy_gather=None,
    engine: str = "auto",
    generator: torch.Generator | None = None,
    **flat,
) -> PolicyLossOutput:
    """GRPO-family policy loss of one micro-batch.

    Args:
        logps: (B, T) log-probs of the sampled tokens under the current policy (grad flows).
        old_logps: (B, T) log-probs under the rollout policy, or ``None`` when exactly on-policy.
        advantages: (B,) or (B, 1) one advantage per completion.
        mask: (B, T) 1 for completion tokens that count, 0 otherwise.
        settings: the objective (:class:`LossSettings`), or a ``loss_type`` name; None: ``"dapo"``. Instead of an
            object, the same fields may be given as keywords named as ``GRPOConfig``'s
            (``loss_type="vespo", epsilon=0.3, vespo_k_pos=1.5``).
        scale: where this micro-batch stands in its optimizer step (:class:`LossScale`); its fields may also be
            given as keywords (``gradient_accumulation_steps=4``, ``num_items_in_batch=...``).
        ref_logps: (B, T) reference-model log-probs (needed when ``beta != 0``).
        sampler_ratio: the rollout-engine mismatch ratio ``ρ``, (B, T) or (B, 1); multiplies ``ℓ`` (a loss whose
            spec says ``sampler_ratio="fold"`` folds a token-level ``ρ`` into its own weight and refuses (B, 1)).
        sampler_logps: (B, T) the sampler's log-probs (the off-policy mask's reference when given).
        entropies: (B, T) token entropies (metric; needed by ``top_entropy_quantile < 1``).
        entropy_gather: under data parallelism, gathers every rank's valid-token entropies for the
            ``top_entropy_quantile`` threshold (see :func:`.masks.high_entropy_mask`); None: this micro-batch only.
        engine: ``"closed_form"`` computes the value and the gradient w.r.t. ``logps`` together, without an
            autograd graph (few passes over (B, T), one multiply in backward); ``"autograd"`` differentiates the
            loss's definition; ``"auto"`` (default) takes the closed form where the loss has one. Both give the
            same loss, gradient and metrics up to float rounding. Neither supports double backward.
        generator: randomness for losses that sample tokens (Clip-Cov); None: torch's global generator.

    Returns :class:`PolicyLossOutput`.
    """
    settings, scale = _resolve(settings, scale, flat)
    spec = settings.spec
    x = _check_inputs(spec, settings, logps, old_logps, advantages, mask, ref_logps, sampler_ratio, sampler_logps,
                      entropies)
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not supported; allowed: {', '.join(ENGINES)}")
    if engine == "closed_form" and spec.closed_form is None:
        raise ValueError(f"loss_type={spec.name!r} has no closed form; use engine='autograd' or 'auto'")
    if engine != "autograd" and spec.closed_form is not None:
        return _closed_form_loss(spec, settings, scale, x, entropy_gather)
    return _autograd_loss(spec, settings, scale, x, entropy_gather, generator)


def _resolve(settings, scale, flat) -> tuple[LossSettings, LossScale]:
    """The settings object and the scale from the arguments (objects, a loss name, or flat keywords)."""
    scale_kw = {k: flat.pop(k) for k in list(flat) if k in _SCALE_FIELDS}
    if scale_kw and scale is not None:
        raise TypeError(f"give the scale either as scale= or as keywords {sorted(scale_kw)}, not both")
    scale = scale if scale is not None else LossScale(**scale_kw)
    if isinstance(settings, LossSettings):
        if flat:
            raise TypeError(f"give the loss settings either as an object or as keywords {sorted(flat)}, not both")
        return settings, scale
    if isinstance(settings, str):
        if "loss_type" in flat:
            raise TypeError("loss_type is given twice (positionally and as a keyword)")
        flat["loss_type"] = settings
    elif settings is not None:
        raise TypeError(f"settings must be a LossSettings or a loss_type name, got {type(settings).__name__}")
    return LossSettings.from_kwargs(**flat), scale


def _check_2d(name: str, x: torch.Tensor | None, shape: torch.Size, allow_row: bool = False) -> None:
    if x is None:
        return
    ok = tuple(x.shape) == tuple(shape) or (allow_row and tuple(x.shape) == (shape[0], 1))
    if not ok:
        allowed = f"{tuple(shape)}" + (f" or {(shape[0], 1)}" if allow_row else "")
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {allowed} (the shape of logps)")


def _check_inputs(spec: LossSpec, s: LossSettings, logps, old_logps, advantages, mask, ref_logps, sampler_ratio,
                  sampler_logps, entropies) -> _Inputs:
    if logps.dim() != 2:
        raise ValueError(f"logps has shape {tuple(logps.shape)}; expected 2 dimensions (B, T)")
    shape = logps.shape
    for name, value in (("mask", mask), ("old_logps", old_logps), ("ref_logps", ref_logps),
                        ("entropies", entropies), ("sampler_logps", sampler_logps)):
        _check_2d(name, value, shape)
    _check_2d("sampler_ratio", sampler_ratio, shape, allow_row=True)
    given_shape = tuple(advantages.shape)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if tuple(advantages.shape) != (shape[0], 1):
        raise ValueError(f"advantages has shape {given_shape}; expected ({shape[0]},) or ({shape[0]}, 1)")
    if spec.sampler_ratio == "fold" and sampler_ratio is not None and sampler_ratio.shape[-1] == 1 and shape[-1] != 1:
        raise ValueError(
            f"sampler_ratio has shape {tuple(sampler_ratio.shape)} (sequence level), which loss_type={spec.name!r} "
            "cannot use: it would be raised to the power of the length inside the sequence weight. Use a "
            "token-level correction (vllm_importance_sampling_mode 'token_truncate' or 'token_mask')."
        )
    if s.beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={s.beta} needs ref_logps (the reference model's log-probs); got None")
    if s.top_entropy_quantile < 1.0 and entropies is None:
        raise ValueError(f"top_entropy_quantile={s.top_entropy_quantile} needs entropies; got None")
    return _Inputs(lp=logps, old=old_logps, A=advantages.to(logps.dtype), mask=mask.to(logps.dtype), ref=ref_logps,
                   sampler_ratio=sampler_ratio, sampler_logps=sampler_logps, entropies=entropies)


def _keep(spec: LossSpec, s: LossSettings, x: _Inputs, entropy_gather) -> torch.Tensor | None:
    """The detached multipliers of ``ℓ``: the off-policy sequence mask, the high-entropy mask and the sampler ratio
    (unless the loss folds it into its own weight); None when there are none."""
    keep = None
    if s.off_policy_mask_threshold is not None:
        reference = x.sampler_logps if x.sampler_logps is not None else (x.old if x.old is not None else x.lp)
        keep = off_policy_sequence_mask(x.A, x.lp, reference, x.mask, s.off_policy_mask_threshold)
    if s.top_entropy_quantile < 1.0:
        hem = high_entropy_mask(x.entropies, x.mask, s.top_entropy_quantile, entropy_gather)
        keep = hem if keep is None else keep * hem
    if x.sampler_ratio is not None and spec.sampler_ratio == "multiply":
        rho = x.sampler_ratio.detach().to(x.lp.dtype)
        keep = rho if keep is None else keep * rho
    return keep


def _context(spec: LossSpec, s: LossSettings, x: _Inputs, d, log_w, **extra) -> LossContext:
    folded = x.sampler_ratio.detach() if x.sampler_ratio is not None and spec.sampler_ratio == "fold" else None
    return LossContext(lp=x.lp, d=d, log_w=log_w, A=x.A, mask=x.mask, eps_lo=float(s.epsilon), eps_hi=s.eps_hi,
                       delta=s.delta, params=s.params, sampler_ratio=folded, **extra)


def _autograd_loss(spec, s: LossSettings, scale: LossScale, x: _Inputs, entropy_gather, generator):
    """The definitions differentiated by autograd."""
    d = token_log_ratio(x.lp, x.old)
    log_w = log_importance_weights(d, x.mask, s.importance_sampling_level)
    per_token, metrics = spec.term(_context(spec, s, x, d, log_w, generator=generator))
    keep = _keep(spec, s, x, entropy_gather)
    if keep is not None:
        per_token = per_token * keep
    if s.beta != 0.0:
        kl = k3_kl(x.lp, x.ref, d if s.use_bias_correction_kl else None)
        per_token = per_token + s.beta * kl
        metrics["kl"] = masked_mean(kl, x.mask)
    if x.entropies is not None:
        metrics["entropy"] = masked_mean(x.entropies, x.mask)
    return PolicyLossOutput(loss=aggregate_loss(per_token, x.mask, spec.aggregation, scale), metrics=metrics)


class _WithGradient(torch.autograd.Function):
    """A loss value whose gradient w.r.t. ``logps`` was computed with it: backward is one multiply."""

    @staticmethod
    def forward(ctx, logps, value, grad):
        ctx.save_for_backward(grad)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad * grad_out, None, None


def _closed_form_loss(spec, s: LossSettings, scale: LossScale, x: _Inputs, entropy_gather) -> PolicyLossOutput:
    """The same steps as :func:`_autograd_loss`, each with its derivative, without a graph: ``loss = Σ E·ℓ +
    β·Σ W·KL`` with ``W`` the aggregation weights and ``E = W·keep``; ``∂loss/∂lp`` by the chain rule through the
    level's log-ratio and the ±20 clamp of ``d``; backward is one multiply (:class:`_WithGradient`)."""
    with torch.no_grad():
        value, grad, metrics, linear = _closed_form_value_and_grad(spec, s, scale, x, entropy_gather)
    lp = x.lp
    if linear:  # value = Σ grad·lp with grad detached: autograd's own dot gives the value and the gradient
        value = torch.dot(lp.reshape(-1), grad.reshape(-1))
    elif lp.requires_grad and torch.is_grad_enabled():
        value = _WithGradient.apply(lp, value, grad)
    return PolicyLossOutput(loss=value, metrics=metrics)


def _closed_form_value_and_grad(spec, s: LossSettings, scale: LossScale, x: _Inputs, entropy_gather):
    lp, mask, level = x.lp, x.mask, s.importance_sampling_level
    if x.old is None:  # exactly on-policy: d = lp - sg[lp] = 0, and the clamp passes every gradient
        raw, d = None, torch.zeros_like(lp)
    else:
        raw = lp - x.old
        d = torch.clamp(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rows = mask.sum(-1, keepdim=True) if level == "sequence" or spec.aggregation == "sequence_mean" else None
    denom = (rows.sum() if rows is not None else mask.sum()).clamp(min=1.0)
    if level == "sequence":  # log w_i = Σ_t m·d / |o_i|
        log_w = torch.linalg.vecdot(d, mask).unsqueeze(-1) / rows.clamp(min=1.0)
    else:
        log_w = log_importance_weights(d, mask, level)
    agg_scale = aggregation_scale(mask, spec.aggregation, scale, rows=rows)
    E = LossWeights(mask=mask, scale=agg_scale, keep=_keep(spec, s, x, entropy_gather), rows=rows)
    cf = spec.closed_form(_context(spec, s, x, d, log_w, mask_denom=denom), E)
    value, metrics, grad = cf.value, cf.metrics, cf.g_lp
    linear = cf.linear and s.beta == 0.0
    if cf.linear and not linear:
        value = torch.dot(grad.reshape(-1), lp.reshape(-1))
    g_d = cf.g_d
    if cf.g_log_w is not None:
        g_w = cf.g_log_w
        if level == "sequence":  # log w_i = Σ_t m·d / |o_i|
            g_w = (g_w / E.row_totals().clamp(min=1.0)) * mask
        g_d = g_w if g_d is None else g_d + g_w
    in_range = None  # 1.0 where the ±20 clamp of d passes the gradient, 0.0 where it clamped
    if raw is not None and (g_d is not None or (s.beta != 0.0 and s.use_bias_correction_kl)):
        in_range = torch.heaviside(raw.abs_().neg_().add_(LOG_RATIO_CLAMP), constant(1.0, lp))
    if g_d is not None:
        if in_range is not None:
            g_d = g_d * in_range if g_d.shape != in_range.shape else g_d.mul_(in_range)
        grad = g_d if grad is None else grad + g_d
    if s.beta != 0.0:  # + β·KL per token, aggregated with the mask and normaliser only (not the multipliers of ℓ)
        kl, dkl = k3_kl_closed_form(lp, x.ref, d if s.use_bias_correction_kl else None, in_range)
        w_kl = mask * (s.beta * agg_scale)
        value = value + torch.dot(w_kl.reshape(-1), kl.reshape(-1))
        grad = w_kl * dkl if grad is None else grad + w_kl * dkl
        metrics["kl"] = masked_mean(kl, mask, denom)
    if x.entropies is not None:
        metrics["entropy"] = masked_mean(x.entropies, mask, denom)
    if grad is None:
        grad = torch.zeros_like(lp)
    elif grad.shape != lp.shape or grad.dtype != lp.dtype:
        grad = grad.expand_as(lp).to(lp.dtype).contiguous()
    return (None if linear else value.to(lp.dtype)), grad, metrics, linear
