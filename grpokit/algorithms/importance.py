"""Importance ratios: the policy/behaviour log-ratio at token, sequence and sequence_token level, and the
sampler/trainer mismatch ratio of a rollout engine (docs/algorithms.md).

Pure torch; shapes: ``B`` rows, ``T`` padded completion tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masked import masked_row_mean

LOG_RATIO_CLAMP = 20.0
"""Every log-ratio is clamped to ±20 before any ``exp`` so that nothing overflows."""

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop",
                            "sequence_geometric_mask")
"""TRL 1.16's four, IcePop's two-sided token band and a sequence band on the geometric mean of the token ratio."""


def token_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor | None) -> torch.Tensor:
    """``d[i,t] = clamp(lp - old, -20, 20)``.

    ``old_logps=None`` means exactly on-policy: ``old = sg[lp]``, so every ratio is 1 while the gradient of
    ``d`` w.r.t. ``lp`` is still 1 (``d = lp - sg[lp]``).
    """
    old = logps.detach() if old_logps is None else old_logps.detach()
    return torch.clamp(logps - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def log_importance_weights(d: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Log importance weight at the chosen level.

    - ``token`` (GRPO/PPO): ``log r[i,t] = d[i,t]``, shape (B, T).
    - ``sequence`` (GSPO, arXiv 2507.18071 eq. 7): ``log s_i = (1/|o_i|) Σ_t d[i,t]``, the log of the
      length-normalised sequence ratio ``(π(o_i)/π_old(o_i))^(1/|o_i|)``, shape (B, 1); the gradient reaches
      every token through the mean.
    - ``sequence_token`` (GSPO-token, §4.3): ``log s_i,t = sg[log s_i] + lp_t - sg[lp_t]``: numerically the
      sequence value at every token, but the gradient of each token's term flows only through its own
      ``lp_t`` (so per-token advantages are allowed), shape (B, T).
    """
    if level == "token":
        return d
    seq = masked_row_mean(d, mask)
    if level == "sequence":
        return seq
    if level == "sequence_token":
        return seq.detach() + d - d.detach()
    raise ValueError(
        f"importance_sampling_level={level!r} is not supported; allowed: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
    )


@torch.no_grad()
def sampler_importance_ratio(
    old_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Truncated / masked importance ratio between the trainer's behaviour policy and the rollout engine.

    ``δ[i,t] = (old - lp_sampler)·m``. ``token_*``: ``ρ = exp(δ)`` (B, T); ``sequence_*``: ``ρ = exp(Σ_t δ)``
    (B, 1), the product ratio. ``*_truncate``: ``ρ = clamp(ρ, clip_min, clip_max)`` (TIS);
    ``*_mask``: ``ρ = ρ·1[clip_min ≤ ρ ≤ clip_max]`` (MIS). An unset bound is ±∞.

    - ``icepop`` (IcePop, Ling Team, "Every Step Evolves", the Ring-1T report, 2025): the token ratio inside a two-sided band,
      ``ρ = exp(δ)·1[clip_min ≤ exp(δ) ≤ clip_max]``, both bounds required (the paper's 0.5 and 5): tokens whose
      engine and trainer probabilities disagree either way take no part.
    - ``sequence_geometric_mask``: the sequence's geometric mean ratio ``ρ = exp(Σ_t δ / Σ_t m)`` (B, 1), kept inside
      ``[clip_min, clip_max]``: a length-normalised sequence test (verl's geometric rejection), which the product
      ratio of ``sequence_mask`` is not — one long sequence's product drifts far from 1 with no token far from it.

    The result is detached: it multiplies the per-token loss as a constant weight.
    """
    if mode not in SAMPLER_CORRECTION_MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode={mode!r} is not supported; allowed: {', '.join(SAMPLER_CORRECTION_MODES)}"
        )
    if mode == "icepop" and (clip_min is None or clip_max is None):
        raise ValueError(f"vllm_importance_sampling_mode='icepop' needs both bounds, got clip_min={clip_min!r} and "
                         f"clip_max={clip_max!r}: set vllm_importance_sampling_clip_min and _clip_max (IcePop: 0.5, 5)")
    delta = torch.nan_to_num(old_logps - sampler_logps, nan=0.0) * mask
    if mode == "sequence_geometric_mask":
        delta = delta.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    elif mode.startswith("sequence"):
        delta = delta.sum(-1, keepdim=True)
    rho = torch.exp(delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return rho.clamp(min=lo, max=hi)
    keep = (rho >= lo) & (rho <= hi)
    return rho * keep.to(rho.dtype)


def sampler_mismatch_metrics(old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                             rho: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """How far the engine's distribution is from the trainer's on a batch, over the valid tokens (``mask``; tokens the
    engine could not score, NaN, left out), with ``δ = old - lp_sampler`` and the tokens drawn from the engine:

    - ``mismatch_kl_k1`` ``= mean(-δ)`` and ``mismatch_kl_k3`` ``= mean(exp(δ) - δ - 1)``: estimates of
      ``KL(π_sampler ‖ π_trainer)`` (k1 unbiased, k3 unbiased and never negative; Schulman's estimators);
    - ``importance_sampling_ratio/p05|p50|p95``: quantiles of the token ratio ``exp(δ)``;
    - with the correction's weights ``rho`` ((B, T) or (B, 1)): ``masked_token_frac``, the share of valid tokens
      whose weight is 0, and ``masked_sequence_frac``, the share of rows with a valid token whose every weight is 0.
    """
    valid = mask.bool() & ~torch.isnan(sampler_logps) & ~torch.isnan(old_logps)
    delta = (old_logps - sampler_logps)[valid].float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if delta.numel() == 0:
        return {}
    ratio = torch.exp(delta)
    out = {"mismatch_kl_k1": (-delta).mean(), "mismatch_kl_k3": (ratio - delta - 1).mean()}
    quantiles = torch.quantile(ratio[:1_000_000], ratio.new_tensor([0.05, 0.5, 0.95]))
    out.update({f"importance_sampling_ratio/p{q:02d}": v for q, v in zip((5, 50, 95), quantiles)})
    if rho is not None:
        zero = (rho.expand_as(valid) == 0) & valid
        rows = valid.any(-1)
        out["masked_token_frac"] = zero.sum() / valid.sum()
        out["masked_sequence_frac"] = ((zero.sum(-1) == valid.sum(-1)) & rows).sum() / rows.sum().clamp_min(1)
    return out



@dataclass(frozen=True)
class SamplerCorrection:
    """The sampler correction a run asks for (TRL's ``vllm_importance_sampling_correction``, ``_mode``, ``_clip_min``,
    ``_clip_max``), applied to one batch by calling it."""

    correct: bool = True
    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    @classmethod
    def from_config(cls, args) -> SamplerCorrection:
        return cls(args.vllm_importance_sampling_correction, args.vllm_importance_sampling_mode,
                   args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)

    def __call__(self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """One batch's sampler/trainer mismatch: the correction's weights ``ρ`` (:func:`sampler_importance_ratio`;
        None when not ``correct``) and what is logged of it, by name under ``sampling/``:

        - ``sampling_logp_difference/mean|max``: ``|old - lp_sampler|`` over the valid tokens the sampler scored;
        - :func:`sampler_mismatch_metrics` (the mismatch KL, the token ratio's quantiles, the masked shares);
        - with ``ρ``: ``importance_sampling_ratio/min|mean|max`` over the valid tokens (a sequence mode: the rows).

        ``trainer_logps``: the behaviour policy's on the sampler's support (``old``); ``mask``: the loss's tokens."""
        mask = mask.float()
        rho = (sampler_importance_ratio(trainer_logps, sampler_logps, mask, self.mode, self.clip_min, self.clip_max)
               if self.correct else None)
        valid = mask.bool()
        gap = (trainer_logps - sampler_logps)[valid].abs()
        gap = gap[~torch.isnan(gap)]  # tokens the sampler could not score
        zero = gap.new_zeros(())
        out = {"sampling_logp_difference/mean": gap.mean() if gap.numel() else zero,
               "sampling_logp_difference/max": gap.max() if gap.numel() else zero}
        out.update(sampler_mismatch_metrics(trainer_logps, sampler_logps, mask, rho))
        if rho is not None:
            kept = (rho.expand_as(valid)[valid] if rho.shape[-1] != 1 else rho.flatten()).float()
            for stat in ("min", "mean", "max"):
                out[f"importance_sampling_ratio/{stat}"] = getattr(kept, stat)() if kept.numel() else kept.new_zeros(())
        return rho, out
