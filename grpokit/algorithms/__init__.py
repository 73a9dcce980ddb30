"""The GRPO-family math as pure torch functions (see ALGORITHMS.md). Imports only torch."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    AdvantageResult,
    compute_advantages,
    dynamic_sampling_keep,
    group_advantages,
    overlong_penalty,
    zero_std_groups,
)
from .aggregation import aggregate_loss
from .importance import (
    IMPORTANCE_SAMPLING_LEVELS,
    SAMPLER_CORRECTION_MODES,
    log_importance_weights,
    sampler_importance_ratio,
    token_log_ratio,
)
from .kl import k3_kl
from .losses import LOSS_TYPES, LOSSES, LossContext, register_loss, vespo_weights
from .masks import high_entropy_mask, off_policy_sequence_mask
from .policy import PolicyLossOutput, policy_loss, resolve_epsilon_high

__all__ = [
    "ADVANTAGE_ESTIMATORS", "IMPORTANCE_SAMPLING_LEVELS", "LOSSES", "LOSS_TYPES", "MULTI_OBJECTIVE_AGGREGATIONS",
    "SAMPLER_CORRECTION_MODES", "SCALE_REWARDS", "AdvantageResult", "LossContext", "PolicyLossOutput",
    "aggregate_loss", "compute_advantages", "dynamic_sampling_keep", "group_advantages", "high_entropy_mask",
    "k3_kl", "log_importance_weights", "off_policy_sequence_mask", "overlong_penalty", "policy_loss",
    "register_loss", "resolve_epsilon_high", "sampler_importance_ratio", "token_log_ratio", "vespo_weights",
    "zero_std_groups",
]
