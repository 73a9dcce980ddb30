"""``policy_loss``: the one entry point of the loss math (ALGORITHMS.md §1–§6).

Order of operations, per micro-batch:
1. token log-ratio ``d = clamp(lp - old, -20, 20)``; the level's log weight (§1);
2. the per-token loss of ``loss_type`` from the registry (§2);
3. masks on ``ℓ``: off-policy sequence mask, high-entropy mask, sampler ratio ``ρ`` (§6, §5);
4. ``+ β·KL`` (§4);
5. aggregation to a scalar (§3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .aggregation import SEQUENCE_MEAN, aggregate_loss, aggregation_scale
from .importance import IMPORTANCE_SAMPLING_LEVELS, LOG_RATIO_CLAMP, log_importance_weights, token_log_ratio
from .kl import k3_kl, k3_kl_closed_form
from .losses import CLOSED_FORMS, LOSSES, LossContext, LossWeights, _constant, masked_mean
from .masks import high_entropy_mask, off_policy_sequence_mask

logger = logging.getLogger("grpokit")

CISPO_DEFAULT_EPSILON_HIGH = 5.0
"""CISPO's absolute cap on the IS weight when ``epsilon_high`` is unset (ScaleRL's value)."""

_said_once: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said_once:
        _said_once.add(key)
        logger.warning(message)


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    """Scalar, differentiable w.r.t. ``logps``."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached 0-dim tensors (means over this micro-batch), named as TRL logs them."""


def resolve_epsilon_high(loss_type: str, epsilon: float, epsilon_high: float | None) -> float:
    """``epsilon_high`` if set; else ``epsilon``, except CISPO whose cap defaults to 5.0 (logged once)."""
    if epsilon_high is not None:
        return float(epsilon_high)
    if loss_type == "cispo":
        _say_once(
            "cispo_eps",
            f"loss_type='cispo' with epsilon_high unset: capping the IS weight at {CISPO_DEFAULT_EPSILON_HIGH} "
            "(ScaleRL); TRL's default of 0.2 would scale every gradient by 0.2.",
        )
        return CISPO_DEFAULT_EPSILON_HIGH
    return float(epsilon)


def _check_2d(name: str, x: torch.Tensor | None, shape: torch.Size, allow_row: bool = False) -> None:
    if x is None:
        return
    ok = tuple(x.shape) == tuple(shape) or (allow_row and tuple(x.shape) == (shape[0], 1))
    if not ok:
        allowed = f"{tuple(shape)}" + (f" or {(shape[0], 1)}" if allow_row else "")
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {allowed} (the shape of logps)")


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    sampler_ratio: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_gather=None,
    off_policy_mask_threshold: float | None = None,
    sampler_logps: torch.Tensor | None = None,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    num_processes: int = 1,
    engine: str = "auto",
) -> PolicyLossOutput:
    """GRPO-family policy loss of one micro-batch.

    Args:
        logps: (B, T) log-probs of the sampled tokens under the current policy (grad flows).
        old_logps: (B, T) log-probs under the rollout policy, or ``None`` when exactly on-policy.
        advantages: (B,) or (B, 1) one advantage per completion.
        mask: (B, T) 1 for completion tokens that count, 0 otherwise.
        sampler_ratio: the rollout-engine mismatch ratio ``ρ`` (§5), (B, T) or (B, 1); multiplies ``ℓ``
            (VESPO folds a token-level ``ρ`` into its sequence weight instead and rejects a (B, 1) one).
        num_items_in_batch: loss tokens of the whole generation batch on all ranks (dapo/cispo/vespo).
        entropy_gather: under data parallelism, gathers every rank's valid-token entropies for the
            ``top_entropy_quantile`` threshold (see :func:`.masks.high_entropy_mask`); None: this micro-batch only.
        engine: ``"closed_form"`` computes the value and the gradient w.r.t. ``logps`` together, without an
            autograd graph (few passes over (B, T), one multiply in backward); ``"autograd"`` differentiates the
            definitions in :mod:`.losses`; ``"auto"`` (default) takes the closed form where the loss has one.
            Both give the same loss, gradient and metrics up to float rounding. Neither supports double backward.

    See ALGORITHMS.md for every other argument. Returns :class:`PolicyLossOutput`.
    """
    if loss_type not in LOSSES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; allowed: {', '.join(LOSSES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r} is not supported; "
            f"allowed: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
        )
    if logps.dim() != 2:
        raise ValueError(f"logps has shape {tuple(logps.shape)}; expected 2 dimensions (B, T)")
    shape = logps.shape
    _check_2d("mask", mask, shape)
    _check_2d("old_logps", old_logps, shape)
    _check_2d("ref_logps", ref_logps, shape)
    _check_2d("entropies", entropies, shape)
    _check_2d("sampler_logps", sampler_logps, shape)
    _check_2d("sampler_ratio", sampler_ratio, shape, allow_row=True)
    given_shape = tuple(advantages.shape)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if tuple(advantages.shape) != (shape[0], 1):
        raise ValueError(f"advantages has shape {given_shape}; expected ({shape[0]},) or ({shape[0]}, 1)")
    if loss_type == "vespo" and sampler_ratio is not None and sampler_ratio.shape[-1] == 1 and shape[-1] != 1:
        raise ValueError(
            f"sampler_ratio has shape {tuple(sampler_ratio.shape)} (sequence level), which VESPO cannot use: it would "
            "be raised to the power of the length inside the sequence weight. Use a token-level correction "
            "(vllm_importance_sampling_mode 'token_truncate' or 'token_mask')."
        )
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference model's log-probs); got None")
    if not 0.0 < top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile} is outside the allowed range (0, 1]")
    if top_entropy_quantile < 1.0 and entropies is None:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile} needs entropies; got None")

    if engine not in ("auto", "autograd", "closed_form"):
        raise ValueError(f"engine={engine!r} is not supported; allowed: auto, autograd, closed_form")
    if engine == "closed_form" and loss_type not in CLOSED_FORMS:
        raise ValueError(f"loss_type={loss_type!r} has no closed form; use engine='autograd' or 'auto'")

    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps.dtype)
    eps_hi = resolve_epsilon_high(loss_type, epsilon, epsilon_high)
    agg = dict(max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
               gradient_accumulation_steps=gradient_accumulation_steps, steps_per_generation=steps_per_generation,
               num_processes=num_processes)
    loss_kw = dict(eps_lo=float(epsilon), eps_hi=eps_hi, delta=delta, vespo_k_pos=vespo_k_pos,
                   vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
                   sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg)
    if engine != "autograd" and loss_type in CLOSED_FORMS:
        with torch.no_grad():
            value, grad, metrics, linear = _closed_form_loss(
                logps, old_logps, advantages, mask, loss_type, importance_sampling_level, loss_kw, agg,
                beta=beta, ref_logps=ref_logps, use_bias_correction_kl=use_bias_correction_kl,
                sampler_ratio=sampler_ratio, entropies=entropies, top_entropy_quantile=top_entropy_quantile,
                entropy_gather=entropy_gather, off_policy_mask_threshold=off_policy_mask_threshold,
                sampler_logps=sampler_logps,
            )
        if linear:  # value = Σ grad·lp with grad detached: autograd's own dot gives the value and the gradient
            value = torch.dot(logps.reshape(-1), grad.reshape(-1))
        elif logps.requires_grad and torch.is_grad_enabled():
            value = _WithGradient.apply(logps, value, grad)
        return PolicyLossOutput(loss=value, metrics=metrics)

    d = token_log_ratio(logps, old_logps)
    log_w = log_importance_weights(d, mask, importance_sampling_level)
    ctx = LossContext(
        lp=logps, d=d, log_w=log_w, A=advantages, mask=mask,
        sampler_ratio=sampler_ratio.detach() if sampler_ratio is not None and loss_type == "vespo" else None, **loss_kw,
    )
    per_token, metrics = LOSSES[loss_type](ctx)

    if off_policy_mask_threshold is not None:
        if sampler_logps is not None:
            reference = sampler_logps
        else:
            reference = old_logps if old_logps is not None else logps.detach()
        per_token = per_token * off_policy_sequence_mask(
            advantages, logps, reference, mask, off_policy_mask_threshold
        )
    if top_entropy_quantile < 1.0:
        per_token = per_token * high_entropy_mask(entropies, mask, top_entropy_quantile, entropy_gather)
    if sampler_ratio is not None and loss_type != "vespo":
        per_token = per_token * sampler_ratio.detach().to(per_token.dtype)
    if beta != 0.0:
        kl = k3_kl(logps, ref_logps, d if use_bias_correction_kl else None)
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl, mask)
    if entropies is not None:
        metrics["entropy"] = masked_mean(entropies, mask)

    loss = aggregate_loss(per_token, mask, loss_type, **agg)
    return PolicyLossOutput(loss=loss, metrics=metrics)


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


def _closed_form_loss(
    logps, old_logps, advantages, mask, loss_type, level, loss_kw, agg, *, beta, ref_logps, use_bias_correction_kl,
    sampler_ratio, entropies, top_entropy_quantile, entropy_gather, off_policy_mask_threshold, sampler_logps,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor], bool]:
    """The same steps as the autograd path, each with its derivative: ``loss = Σ E·ℓ + β·Σ W·KL`` with ``W`` the
    aggregation weights and ``E = W·`` (the detached masks and sampler ratio); ``∂loss/∂lp`` by the chain rule
    through the level's log-ratio and the ±20 clamp of ``d``. Called under ``no_grad``."""
    lp = logps
    if old_logps is None:  # exactly on-policy: d = lp - sg[lp] = 0, and the clamp passes every gradient
        raw, d = None, torch.zeros_like(lp)
    else:
        raw = lp - old_logps
        d = torch.clamp(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    need_rows = level == "sequence" or loss_type in SEQUENCE_MEAN or loss_type == "gmpo"
    rows = mask.sum(-1, keepdim=True) if need_rows else None
    denom = (rows.sum() if rows is not None else mask.sum()).clamp(min=1.0)
    if level == "sequence":  # log w_i = Σ_t m·d / |o_i|
        log_w = torch.linalg.vecdot(d, mask).unsqueeze(-1) / rows.clamp(min=1.0)
    else:
        log_w = log_importance_weights(d, mask, level)
    scale = aggregation_scale(mask, loss_type, rows=rows, **agg)

    keep = None  # the detached multipliers of ℓ (§6, §5)
    if off_policy_mask_threshold is not None:
        reference = sampler_logps if sampler_logps is not None else (old_logps if old_logps is not None else lp)
        keep = off_policy_sequence_mask(advantages, lp, reference, mask, off_policy_mask_threshold)
    if top_entropy_quantile < 1.0:
        hem = high_entropy_mask(entropies, mask, top_entropy_quantile, entropy_gather)
        keep = hem if keep is None else keep * hem
    if sampler_ratio is not None and loss_type != "vespo":
        rho = sampler_ratio.detach().to(lp.dtype)
        keep = rho if keep is None else keep * rho
    E = LossWeights(mask=mask, scale=scale, keep=keep, rows=rows)

    ctx = LossContext(
        lp=lp, d=d, log_w=log_w, A=advantages, mask=mask, mask_denom=denom,
        sampler_ratio=sampler_ratio.detach() if sampler_ratio is not None and loss_type == "vespo" else None, **loss_kw,
    )
    cf = CLOSED_FORMS[loss_type](ctx, E)
    value, metrics, grad = cf.value, cf.metrics, cf.g_lp
    linear = cf.linear and beta == 0.0
    if cf.linear and not linear:
        value = torch.dot(grad.reshape(-1), lp.reshape(-1))
    g_d = cf.g_d
    if cf.g_log_w is not None:
        g_w = cf.g_log_w
        if level == "sequence":  # log w_i = Σ_t m·d / |o_i|
            g_w = (g_w / E.row_totals().clamp(min=1.0)) * mask
        g_d = g_w if g_d is None else g_d + g_w
    in_range = None  # 1.0 where the ±20 clamp of d passes the gradient, 0.0 where it clamped
    if raw is not None and (g_d is not None or (beta != 0.0 and use_bias_correction_kl)):
        in_range = torch.heaviside(raw.abs_().neg_().add_(LOG_RATIO_CLAMP), _constant(1.0, lp))
    if g_d is not None:
        if in_range is not None:
            g_d = g_d * in_range if g_d.shape != in_range.shape else g_d.mul_(in_range)
        grad = g_d if grad is None else grad + g_d
    if beta != 0.0:  # + β·KL per token, aggregated with the mask and normaliser only (not the masks of ℓ)
        kl, dkl = k3_kl_closed_form(lp, ref_logps, d if use_bias_correction_kl else None, in_range)
        w_kl = mask * (beta * scale)
        value = value + torch.dot(w_kl.reshape(-1), kl.reshape(-1))
        grad = w_kl * dkl if grad is None else grad + w_kl * dkl
        metrics["kl"] = masked_mean(kl, mask, denom)
    if entropies is not None:
        metrics["entropy"] = masked_mean(entropies, mask, denom)
    if grad is None:
        grad = torch.zeros_like(lp)
    elif grad.shape != lp.shape or grad.dtype != lp.dtype:
        grad = grad.expand_as(lp).to(lp.dtype).contiguous()
    return (None if linear else value.to(lp.dtype)), grad, metrics, linear
