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

from .aggregation import aggregate_loss
from .importance import IMPORTANCE_SAMPLING_LEVELS, log_importance_weights, token_log_ratio
from .kl import k3_kl
from .losses import LOSSES, LossContext, masked_mean
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

    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps.dtype)
    eps_hi = resolve_epsilon_high(loss_type, epsilon, epsilon_high)

    d = token_log_ratio(logps, old_logps)
    log_w = log_importance_weights(d, mask, importance_sampling_level)
    ctx = LossContext(
        lp=logps, d=d, log_w=log_w, A=advantages, mask=mask, eps_lo=float(epsilon), eps_hi=eps_hi, delta=delta,
        sampler_ratio=sampler_ratio.detach() if sampler_ratio is not None and loss_type == "vespo" else None,
        vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
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
        per_token = per_token * high_entropy_mask(entropies, mask, top_entropy_quantile)
    if sampler_ratio is not None and loss_type != "vespo":
        per_token = per_token * sampler_ratio.detach().to(per_token.dtype)
    if beta != 0.0:
        kl = k3_kl(logps, ref_logps, d if use_bias_correction_kl else None)
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl, mask)
    if entropies is not None:
        metrics["entropy"] = masked_mean(entropies, mask)

    loss = aggregate_loss(
        per_token, mask, loss_type,
        max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
        gradient_accumulation_steps=gradient_accumulation_steps, steps_per_generation=steps_per_generation,
        num_processes=num_processes,
    )
    return PolicyLossOutput(loss=loss, metrics=metrics)
