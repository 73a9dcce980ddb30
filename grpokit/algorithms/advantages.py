"""Group-relative advantages, multi-reward aggregation, RLOO, DAPO's dynamic-sampling filter and overlong
reward shaping (docs/algorithms.md §7).

Rows are ordered by group: the ``G = num_generations`` completions of one prompt are consecutive.
``NaN`` in a reward means "not applicable" and is skipped by every sum and mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .advantage_estimators import STD_EPS, get_advantage_estimator
from .masked import nanstd  # noqa: F401 - where the trainer and older code import it from

SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
ZERO_STD_RTOL = 1e-6


def normalize_scale_rewards(scale_rewards: str | bool) -> str:
    """``True`` means ``"group"``, ``False`` means ``"none"`` (TRL's older booleans)."""
    if scale_rewards is True:
        return "group"
    if scale_rewards is False:
        return "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not supported; allowed: {', '.join(SCALE_REWARDS)}, True, False")
    return scale_rewards


def _nan_range(x: torch.Tensor, dim: int) -> torch.Tensor:
    finite = ~torch.isnan(x)
    hi = torch.where(finite, x, torch.full_like(x, -torch.inf)).amax(dim)
    lo = torch.where(finite, x, torch.full_like(x, torch.inf)).amin(dim)
    return torch.where(finite.any(dim), hi - lo, torch.zeros_like(hi))


def zero_std_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per group (n_groups,): True if all its valid rewards are equal (within a relative 1e-6: float rounding of
    the std would otherwise hide exact ties, as TRL's ``isclose(std, 0)`` does) or it has fewer than two."""
    grouped = rewards.view(-1, num_generations)
    scale = 1.0 + torch.nan_to_num(torch.nanmean(grouped, dim=1).abs(), nan=0.0)
    few = (~torch.isnan(grouped)).sum(1) < 2
    return (_nan_range(grouped, 1) <= ZERO_STD_RTOL * scale) | few


@dataclass
class AdvantageResult:
    advantages: torch.Tensor
    """(N,) one advantage per completion; 0 exactly for tied groups and unscorable rows."""
    rewards: torch.Tensor
    """(N,) the aggregated reward ``R`` the advantages are computed from (NaN for rows every function skipped)."""
    weighted: torch.Tensor
    """(N,) ``Σ_k w_k·r_k`` of the raw rewards (NaN for rows every function skipped): the logged ``reward``, as in
    TRL. Equal to ``rewards`` for ``sum_then_normalize``; under ``normalize_then_sum`` ``rewards`` is a sum of
    group-normalised values (0 for constant rewards) and says nothing about how good the completions were."""
    zero_std: torch.Tensor
    """(N,) True where the row's group had no reward spread (no learning signal)."""


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    reward_weights: torch.Tensor | list[float] | None = None,
    scale_rewards: str | bool = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
    advantage_estimator: str = "grpo",
) -> AdvantageResult:
    """Advantages with the intermediate quantities a trainer logs. See :func:`compute_advantages`."""
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(-1)
    n, k = rewards.shape
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"rewards has {n} rows, which is not a multiple of num_generations={num_generations}")
    scale = normalize_scale_rewards(scale_rewards)
    if multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation={multi_objective_aggregation!r} is not supported; "
            f"allowed: {', '.join(MULTI_OBJECTIVE_AGGREGATIONS)}"
        )
    estimator = get_advantage_estimator(advantage_estimator)
    rewards = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    weights = torch.ones(k, dtype=rewards.dtype, device=rewards.device) if reward_weights is None else (
        torch.as_tensor(reward_weights, dtype=rewards.dtype, device=rewards.device)
    )
    if weights.shape != (k,):
        raise ValueError(f"reward_weights has {weights.numel()} values; expected {k} (one per reward function)")
    unscorable = torch.isnan(rewards).all(-1)
    weighted = (rewards * weights).nansum(-1)
    weighted[unscorable] = torch.nan
    g = num_generations

    if multi_objective_aggregation == "normalize_then_sum":
        grouped = rewards.view(-1, g, k)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        per_func = ((grouped - mean_k) / (torch.nan_to_num(std_k, nan=0.0) + STD_EPS)).view(n, k)
        total = (per_func * weights).nansum(-1)
        total[unscorable] = torch.nan
        zero = zero_std_groups(total, g).repeat_interleave(g)
        std = nanstd(total) if n > 1 else total.new_zeros(())
        adv = (total - torch.nanmean(total)) / (torch.nan_to_num(std, nan=0.0) + STD_EPS)
    else:
        total = weighted
        zero = zero_std_groups(total, g).repeat_interleave(g)
        adv = estimator.advantages(total, g, scale)

    tied = torch.zeros_like(zero) if estimator.ties_teach else zero  # no signal against its own mean, some against others
    adv = torch.where(tied | unscorable, torch.zeros_like(adv), adv)
    adv = torch.nan_to_num(adv, nan=0.0)
    return AdvantageResult(advantages=adv, rewards=total, weighted=weighted, zero_std=zero)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    reward_weights: torch.Tensor | list[float] | None = None,
    scale_rewards: str | bool = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
    advantage_estimator: str = "grpo",
) -> torch.Tensor:
    """Group-relative advantages, (N,), from rewards (N, K) of K reward functions (NaN = not applicable).

    ``sum_then_normalize`` (GRPO, arXiv 2402.03300 §4.1.2): ``R_j = Σ_k w_k·r_jk``;
    ``A_j = (R_j - mean_g R) / (std_g R + 1e-4)`` where ``std`` is the unbiased std of the group (``"group"``), of
    the whole batch (``"batch"``), or omitted (``"none"``: Dr. GRPO, arXiv 2503.20783).
    ``normalize_then_sum`` (GDPO): each reward normalised within its group, weighted and summed, then the sum
    normalised over the batch (``scale_rewards`` is not used).
    ``advantage_estimator="rloo"`` (arXiv 2402.14740): ``A_i = R_i - mean_{j≠i} R_j``, unscaled.
    ``advantage_estimator="reinforce_plus_plus"`` (REINFORCE++, arXiv 2501.03262, global advantage normalisation):
    ``A_i = (R_i - mean_batch R) / (std_batch R + 1e-4)`` over every completion of the batch, the groups ignored
    (``scale_rewards="none"``: centred only). A group whose completions all scored alike then still teaches: below
    the batch's mean it is pushed away from what it sampled, above it pulled towards it. The statistics are over
    completions (verl's ``reinforce_plus_plus`` whitens over tokens: the same for equal lengths).

    Groups whose rewards are all equal get exactly 0 (except under ``reinforce_plus_plus``), and so do rows every
    reward function skipped.
    """
    return group_advantages(
        rewards, num_generations, reward_weights=reward_weights, scale_rewards=scale_rewards,
        multi_objective_aggregation=multi_objective_aggregation, advantage_estimator=advantage_estimator,
    ).advantages


def total_reward(rewards: torch.Tensor, reward_weights: torch.Tensor | list[float] | None = None) -> torch.Tensor:
    """Per row (N,), the total reward ``R = Σ_k w_k·r_k`` of (N, K) per-function rewards (NaN entries skipped; NaN
    where every function skipped the row); a 1-D ``rewards`` is already one."""
    if rewards.dim() != 2:
        return rewards
    w = torch.ones(rewards.shape[1], dtype=rewards.dtype, device=rewards.device) if reward_weights is None else (
        torch.as_tensor(reward_weights, dtype=rewards.dtype, device=rewards.device))
    return torch.where(torch.isnan(rewards).all(-1), torch.nan, torch.nansum(rewards * w, -1))


def dynamic_sampling_keep(rewards: torch.Tensor, num_generations: int,
                          reward_weights: torch.Tensor | list[float] | None = None) -> torch.Tensor:
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2): per group (n_groups,), True if the group's total reward
    ``R = Σ_k w_k·r_k`` (:func:`total_reward`) has spread (keep it), False if every completion scored alike — within
    the tolerance of :func:`zero_std_groups` — or fewer than two are scorable (no gradient: drop it and sample
    more)."""
    return ~zero_std_groups(total_reward(rewards, reward_weights), num_generations)


BEST_TOLERANCE = 1e-6
"""A group below the best reward by less than this (relative to it, at least absolute) is at the best: solved."""


def below_best(group_rewards: list[float], best: float | None) -> bool:
    """GRESO's hard prompts (arXiv 2506.02177): whether a group's best scored total reward is below ``best``, the best
    any completion has had so far — with a 0/1 correctness reward, none of the group's completions was right. A group
    with nothing scored (NaN) counts as below, as does every group before anything was scored (``best`` None)."""
    scored = [r for r in group_rewards if not math.isnan(r)]
    if not scored or best is None:
        return True
    return max(scored) < best - BEST_TOLERANCE * max(1.0, abs(best))


def skip_probability(streak: int, explore_prob: float) -> float:
    """GRESO's pre-rollout filter (arXiv 2506.02177): a prompt whose last ``z = streak`` groups all scored alike
    (:func:`dynamic_sampling_keep` False) is skipped before generation with probability ``1 - p^z``
    (``p = explore_prob``: the paper's ``p_easy`` or ``p_hard``, by whether the prompt's last group was solved); 0 for
    a prompt never generated, or whose last group had reward spread."""
    return 1.0 - explore_prob ** max(0, streak)


def overlong_penalty(
    completion_lengths: torch.Tensor,
    max_completion_length: int,
    overlong_buffer_length: int,
    overlong_penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476 eq. 13), added to the reward:

    0 for ``len ≤ L - buffer``; ``-(len - (L - buffer)) / buffer · factor`` inside the last ``buffer`` tokens
    (reaching ``-factor`` at ``len = L``); ``-factor`` beyond ``L``.
    """
    if overlong_buffer_length <= 0:
        raise ValueError(f"overlong_buffer_length={overlong_buffer_length} must be a positive number of tokens")
    lengths = completion_lengths.to(torch.float32)
    start = max_completion_length - overlong_buffer_length
    over = ((lengths - start) / overlong_buffer_length).clamp(min=0.0, max=1.0)
    return -over * overlong_penalty_factor
