"""The GRPO-family math as pure torch functions (docs/algorithms.md). Imports only torch.

- :mod:`.losses`: one module per loss, each described by a :class:`LossSpec` in the registry;
- :mod:`.settings`: :class:`LossSettings`, the objective of a run; :mod:`.aggregation`: :class:`LossScale` and the
  normalisers; :mod:`.policy`: :func:`policy_loss`, the entry point;
- :mod:`.importance`, :mod:`.masks`, :mod:`.kl`, :mod:`.entropy`, :mod:`.masked`: the pieces ``policy_loss`` uses;
- :mod:`.advantages`: group-relative advantages, dynamic sampling, overlong shaping; :mod:`.advantage_estimators`: the
  estimators (GRPO, RLOO, REINFORCE++) in a registry.
- :mod:`.averaging`: moving averages of weights (the reference's soft update, ``ema_decay``).
"""

from .advantage_estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    get_advantage_estimator,
    register_advantage_estimator,
)
from .advantages import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    AdvantageResult,
    compute_advantages,
    dynamic_sampling_keep,
    group_advantages,
    overlong_penalty,
    zero_std_groups,
)
from .aggregation import AGGREGATIONS, LossScale, aggregate_loss
from .importance import (
    IMPORTANCE_SAMPLING_LEVELS,
    SAMPLER_CORRECTION_MODES,
    log_importance_weights,
    sampler_importance_ratio,
    token_log_ratio,
)
from .kl import k3_kl
from .losses import LOSS_TYPES, LOSSES, LossContext, LossSpec, loss_spec, param, recipes, register_loss, vespo_weights
from .masks import high_entropy_mask, off_policy_sequence_mask
from .policy import PolicyLossOutput, policy_loss
from .settings import LossSettings, resolve_epsilon_high

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "IMPORTANCE_SAMPLING_LEVELS", "LOSSES", "LOSS_TYPES",
    "MULTI_OBJECTIVE_AGGREGATIONS", "SAMPLER_CORRECTION_MODES", "SCALE_REWARDS", "AdvantageEstimator", "AdvantageResult",
    "LossContext", "LossScale", "LossSettings", "LossSpec", "PolicyLossOutput", "aggregate_loss", "compute_advantages",
    "dynamic_sampling_keep", "get_advantage_estimator", "group_advantages", "high_entropy_mask", "k3_kl",
    "log_importance_weights", "loss_spec", "off_policy_sequence_mask", "overlong_penalty", "param", "policy_loss",
    "recipes", "register_advantage_estimator", "register_loss", "resolve_epsilon_high", "sampler_importance_ratio",
    "token_log_ratio", "vespo_weights", "zero_std_groups",
]
