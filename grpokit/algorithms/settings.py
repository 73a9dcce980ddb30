"""``LossSettings``: the objective a trainer optimises, in one object — which loss, at which importance-sampling
level, with which clip range, KL penalty and masks, and the loss's own hyper-parameters (its spec's ``params``).

Built once per run from the flat ``GRPOConfig`` fields (:meth:`LossSettings.from_config`) or from the same flat
names as keywords (:meth:`LossSettings.from_kwargs`), and handed to :func:`grpokit.algorithms.policy_loss`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from ..validation import refusal
from .importance import IMPORTANCE_SAMPLING_LEVELS
from .losses import LossSpec, config_params, loss_spec

logger = logging.getLogger("grpokit")

_said_once: set[str] = set()


def say_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _said_once:
        _said_once.add(key)
        logger.warning(message)


@dataclass(frozen=True)
class LossSettings:
    """Everything about the objective that is fixed for a run (per-call quantities such as the gradient
    accumulation are in :class:`grpokit.algorithms.aggregation.LossScale`)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = False
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    params: Any = None
    """The loss's own hyper-parameters: an instance of its spec's ``params`` dataclass (None: its defaults)."""

    def __post_init__(self) -> None:
        spec = loss_spec(self.loss_type)
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r} is not supported; "
                             f"allowed: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} is outside the allowed range (0, 1]")
        if self.params is None:
            object.__setattr__(self, "params", spec.default_params())
        elif spec.params is None or not isinstance(self.params, spec.params):
            expected = spec.params.__name__ if spec.params is not None else "None"
            raise ValueError(f"params={self.params!r} does not belong to loss_type={self.loss_type!r}; "
                             f"expected {expected}")

    @property
    def spec(self) -> LossSpec:
        return loss_spec(self.loss_type)

    @property
    def eps_hi(self) -> float:
        """``epsilon_high`` if set; else the loss's default (CISPO: 5.0, said once), else ``epsilon``."""
        return resolve_epsilon_high(self.loss_type, self.epsilon, self.epsilon_high)

    @classmethod
    def from_config(cls, config: Any) -> LossSettings:
        """From any object with ``GRPOConfig``'s flat fields; ``config.loss_params`` (a mapping of the loss's own
        parameter names, if present) overrides the flat fields."""
        spec = loss_spec(config.loss_type)
        flat = {f.metadata["config"]: getattr(config, f.metadata["config"], f.default) for f in spec.param_fields()}
        return cls(
            loss_type=config.loss_type, importance_sampling_level=config.importance_sampling_level,
            epsilon=float(config.epsilon), epsilon_high=config.epsilon_high, delta=config.delta, beta=float(config.beta),
            use_bias_correction_kl=bool(config.use_bias_correction_kl),
            top_entropy_quantile=float(config.top_entropy_quantile),
            off_policy_mask_threshold=config.off_policy_mask_threshold,
            params=build_params(spec, flat, getattr(config, "loss_params", None)),
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LossSettings:
        """From flat keywords named as ``GRPOConfig``'s fields (``loss_type="vespo", vespo_k_pos=1.5``, ...);
        ``loss_params`` as in :meth:`from_config`. Unknown names are an error."""
        own = {f.name for f in dataclasses.fields(cls) if f.name != "params"}
        spec = loss_spec(kwargs.get("loss_type", cls.loss_type))
        known_params = config_params()
        flat, loss_params = {}, kwargs.pop("loss_params", None)
        for key in list(kwargs):
            if key in known_params:
                owner, _ = known_params[key]
                value = kwargs.pop(key)
                if owner is spec:
                    flat[key] = value
        unknown = set(kwargs) - own
        if unknown:
            raise TypeError(f"unknown loss setting(s) {sorted(unknown)}; allowed: {sorted(own | set(known_params))}")
        return cls(**kwargs, params=build_params(spec, flat, loss_params))


def build_params(spec: LossSpec, flat: dict[str, Any], overrides: dict[str, Any] | None = None) -> Any:
    """The loss's hyper-parameter dataclass from its flat config values (``{config_name: value}``) and
    ``overrides`` by parameter name. A name the loss does not have is an error listing the allowed ones."""
    if spec.params is None:
        if overrides:
            raise refusal("loss_params", overrides, f"loss_type={spec.name!r} has no parameters of its own")
        return None
    by_config = {f.metadata["config"]: f.name for f in spec.param_fields()}
    values = {by_config[k]: v for k, v in flat.items() if k in by_config}
    for key, value in (overrides or {}).items():
        if key not in {f.name for f in spec.param_fields()}:
            allowed = ", ".join(f"{f.name} ({f.metadata['config']})" for f in spec.param_fields())
            raise ValueError(f"loss_params key {key!r} is not a parameter of loss_type={spec.name!r}; "
                             f"allowed: {allowed}")
        values[key] = value
    return spec.params(**values)


def resolve_epsilon_high(loss_type: str, epsilon: float, epsilon_high: float | None) -> float:
    """``epsilon_high`` if set; else the loss's ``default_epsilon_high`` (its note said once), else ``epsilon``."""
    if epsilon_high is not None:
        return float(epsilon_high)
    spec = loss_spec(loss_type)
    if spec.default_epsilon_high is not None:
        if spec.default_epsilon_high_note:
            say_once(f"{loss_type}_eps", spec.default_epsilon_high_note)
        return float(spec.default_epsilon_high)
    return float(epsilon)
