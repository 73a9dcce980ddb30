"""The loss registry: every loss is described once, by a :class:`LossSpec`, in its own module of this package.

Everything else is derived from the specs: ``GRPOConfig``'s ``loss_type`` choices, its fields for each loss's own
hyper-parameters (with their defaults, help and bounds), the validation of ``epsilon``/``epsilon_high``, the
sampler-ratio rules, the recipes of ``grpokit demo --algo``, the table in ``docs/algorithms.md`` and the
parametrisation of the generic tests.

A new loss is one module here defining its per-token term and ``register_loss(LossSpec(...))``; the package
imports every module it holds. A loss registered at run time from user code works the same way (its
hyper-parameters are then set through ``GRPOConfig(loss_params={...})``).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..aggregation import AGGREGATIONS
from ..importance import IMPORTANCE_SAMPLING_LEVELS
from ..registry_names import LiveNames
from ._context import ClosedForm, LossContext, LossWeights

TermFn = Callable[[LossContext], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
ClosedFormFn = Callable[[LossContext, LossWeights], ClosedForm]

EPSILON_MEANINGS = {
    "ratio": "ratio clipped to [1-ε, 1+ε_high]",
    "log_ratio": "log-ratio clipped to [-ε, ε_high]",
    "cap": "weight capped at ε_high (absolute)",
    "unused": "not used",
}
SAMPLER_RATIO_RULES = {
    "multiply": "ℓ·sg[ρ]",
    "fold": "token ρ folded into the sequence weight; a sequence ρ is refused",
}


def param(default: float, *, config: str, help: str, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None) -> Any:
    """A field of a loss's hyper-parameter dataclass: its default, the flat ``GRPOConfig`` field that sets it
    (TRL's name where TRL has one), a one-line help, and the allowed range (checked by ``GRPOConfig``)."""
    return field(default=default, metadata={"config": config, "help": help,
                                            "bounds": {"ge": ge, "gt": gt, "le": le, "lt": lt}})


@dataclass(frozen=True)
class LossSpec:
    """Everything grpokit knows about one ``loss_type``."""

    name: str
    summary: str
    """One line: what the loss is (docs table, ``grpokit tasks``)."""
    reference: str
    """Where it comes from (paper, arXiv id)."""
    term: TermFn
    """The per-token loss ``ℓ`` (the definition, differentiated by autograd): ``(LossContext) -> (ℓ, metrics)``,
    ``ℓ`` (B, T) or (B, 1); metrics detached 0-dim tensors."""
    aggregation: str
    """How ``ℓ`` becomes one number per micro-batch: one of :data:`grpokit.algorithms.aggregation.AGGREGATIONS`."""
    closed_form: ClosedFormFn | None = None
    """Value and gradient without autograd (optional, faster); must agree with ``term``."""
    params: type | None = None
    """A frozen dataclass of the loss's own hyper-parameters, its fields made with :func:`param`."""
    epsilon: str = "ratio"
    """What ``epsilon``/``epsilon_high`` mean for this loss: a key of :data:`EPSILON_MEANINGS`."""
    default_epsilon_high: float | None = None
    """``epsilon_high`` when the user leaves it unset (None: ``epsilon``)."""
    default_epsilon_high_note: str | None = None
    """Said once in the log when that default applies."""
    sampler_ratio: str = "multiply"
    """How the rollout engine's mismatch ratio ``ρ`` enters: a key of :data:`SAMPLER_RATIO_RULES`."""
    levels: tuple[str, ...] = IMPORTANCE_SAMPLING_LEVELS
    """The ``importance_sampling_level`` values that change this loss (others are warned to have no effect)."""
    preferred_level: str | None = None
    """The level the loss was designed for (another one is warned about)."""
    batch_dependent: bool = False
    """``ℓ`` of a token depends on the other rows of its micro-batch (e.g. tokens selected by batch statistics), so
    splitting a batch into micro-batches changes the loss."""
    metrics: tuple[str, ...] = ()
    """Metric names the loss reports (as TRL names them where TRL has them)."""
    recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Named algorithm recipes built on this loss: ``grpokit demo --algo NAME`` sets these GRPOConfig fields."""
    in_trl: bool = True
    """TRL 1.16 has this ``loss_type``."""

    def __post_init__(self) -> None:
        problems = []
        if self.aggregation not in AGGREGATIONS:
            problems.append(f"aggregation={self.aggregation!r} (allowed: {', '.join(AGGREGATIONS)})")
        if self.epsilon not in EPSILON_MEANINGS:
            problems.append(f"epsilon={self.epsilon!r} (allowed: {', '.join(EPSILON_MEANINGS)})")
        if self.sampler_ratio not in SAMPLER_RATIO_RULES:
            problems.append(f"sampler_ratio={self.sampler_ratio!r} (allowed: {', '.join(SAMPLER_RATIO_RULES)})")
        bad_levels = [lv for lv in (*self.levels, self.preferred_level) if lv and lv not in IMPORTANCE_SAMPLING_LEVELS]
        if bad_levels:
            problems.append(f"levels {bad_levels} (allowed: {', '.join(IMPORTANCE_SAMPLING_LEVELS)})")
        if self.params is not None and not (dataclasses.is_dataclass(self.params) and isinstance(self.params, type)):
            problems.append(f"params={self.params!r} (expected a dataclass type)")
        if problems:
            raise ValueError(f"loss {self.name!r} is described wrongly: {'; '.join(problems)}")

    def default_params(self) -> Any:
        return self.params() if self.params is not None else None

    def param_fields(self) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(self.params) if self.params is not None else ()


LOSSES: dict[str, LossSpec] = {}
"""Every registered loss by ``loss_type`` name, in registration order."""


def register_loss(spec: LossSpec, *, replace: bool = False) -> LossSpec:
    """Add a loss to the registry (``replace=True`` to redefine a name). Its ``loss_type`` is accepted everywhere
    from then on; its hyper-parameters are set with ``GRPOConfig(loss_params={...})`` when it is registered after
    ``grpokit.config`` was imported (built-in losses also get flat ``GRPOConfig`` fields)."""
    if not isinstance(spec, LossSpec):
        raise TypeError(f"register_loss takes a LossSpec, got {type(spec).__name__}")
    if spec.name in LOSSES and not replace and LOSSES[spec.name] is not spec:
        raise ValueError(f"loss_type {spec.name!r} is already registered; pass replace=True to redefine it")
    taken = {name: s.name for s in LOSSES.values() if s.name != spec.name for name in s.recipes}
    clash = [r for r in spec.recipes if r in taken]
    if clash:
        raise ValueError(f"recipe name(s) {clash} of loss {spec.name!r} are taken by {[taken[r] for r in clash]}")
    LOSSES[spec.name] = spec
    return spec


def loss_spec(name: str) -> LossSpec:
    """The spec of ``loss_type`` ``name``; a ValueError listing the registered names otherwise."""
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"loss_type={name!r} is not supported; allowed: {', '.join(LOSSES)}") from None


LOSS_TYPES: Sequence[str] = LiveNames(LOSSES)
"""The registered ``loss_type`` names, read at each use (so a loss registered later is included)."""


def recipes() -> dict[str, dict[str, Any]]:
    """Every named algorithm recipe (``--algo``): its GRPOConfig fields, ``loss_type`` included."""
    out = {}
    for spec in LOSSES.values():
        for name, fields in spec.recipes.items():
            out[name] = {"loss_type": spec.name, **fields}
    return out


def config_params() -> dict[str, tuple[LossSpec, dataclasses.Field]]:
    """Every hyper-parameter of every registered loss by its flat ``GRPOConfig`` field name."""
    out: dict[str, tuple[LossSpec, dataclasses.Field]] = {}
    for spec in LOSSES.values():
        for f in spec.param_fields():
            name = f.metadata.get("config")
            if not name:
                raise ValueError(f"loss {spec.name!r}: parameter {f.name!r} has no config name (use param(...))")
            if name in out and out[name][0] is not spec:
                raise ValueError(f"config field {name!r} is claimed by losses {out[name][0].name!r} and {spec.name!r}")
            out[name] = (spec, f)
    return out


def param_type(spec: LossSpec, f: dataclasses.Field) -> Any:
    """The resolved type of a hyper-parameter field (annotations may be strings)."""
    return typing.get_type_hints(spec.params)[f.name]


def check_bounds(name: str, value: Any, f: dataclasses.Field) -> str | None:
    """Why ``value`` is refused for the hyper-parameter field ``f`` (None when it is allowed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "expected a number"
    if value != value or value in (float("inf"), float("-inf")):
        return "expected a finite number"
    b = f.metadata.get("bounds", {})
    for key, ok, text in (("ge", lambda v, x: v >= x, ">="), ("gt", lambda v, x: v > x, ">"),
                          ("le", lambda v, x: v <= x, "<="), ("lt", lambda v, x: v < x, "<")):
        if b.get(key) is not None and not ok(value, b[key]):
            return f"must be {text} {b[key]}"
    return None


def loss_table_markdown() -> str:
    """The table of every registered loss for ``docs/algorithms.md`` (a test keeps the file in step with it)."""
    from ..aggregation import AGGREGATIONS

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| loss_type | what it is | source | aggregation | ε / ε_high | own parameters (field = default) | "
            "recipes (`--algo`) | in TRL 1.16 |", "|---|---|---|---|---|---|---|---|"]
    for spec in LOSSES.values():
        params = ", ".join(f"`{f.metadata['config']}`={f.default}" for f in spec.param_fields()) or "—"
        eps = EPSILON_MEANINGS[spec.epsilon]
        if spec.default_epsilon_high is not None:
            eps += f" (ε_high default {spec.default_epsilon_high})"
        rows.append(f"| `{spec.name}` | {cell(spec.summary)} | {cell(spec.reference)} | `{spec.aggregation}`: "
                    f"{AGGREGATIONS[spec.aggregation]} | {eps} | {params} | "
                    f"{', '.join(f'`{r}`' for r in spec.recipes) or '—'} | {'yes' if spec.in_trl else 'no'} |")
    return "\n".join(rows)
