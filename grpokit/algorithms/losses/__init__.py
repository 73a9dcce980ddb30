"""Per-token policy losses ``ℓ[i,t]`` of the GRPO family, one module each, described by a :class:`LossSpec` in a
registry (see ``_registry.py``; the math of each loss is in its module's docstrings and ``docs/algorithms.md``).

Every module of this package that does not start with ``_`` is imported here, so a new loss is one new module
(``clip`` first, the family the others are variations of; then the rest alphabetically, which is the order of
``LOSS_TYPES``).
"""

from __future__ import annotations

import importlib
import pkgutil

from ._context import ClosedForm, LossContext, LossWeights
from ._registry import (
    EPSILON_MEANINGS,
    LOSS_TYPES,
    LOSSES,
    SAMPLER_RATIO_RULES,
    LossSpec,
    config_params,
    loss_spec,
    loss_table_markdown,
    param,
    recipes,
    register_loss,
)

for _module in sorted((m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")),
                      key=lambda name: (name != "clip", name)):
    importlib.import_module(f"{__name__}.{_module}")

from .vespo import vespo_weights  # noqa: E402  (after the discovery loop: it is one of the modules)

__all__ = [
    "EPSILON_MEANINGS", "LOSSES", "LOSS_TYPES", "SAMPLER_RATIO_RULES", "ClosedForm", "LossContext", "LossSpec",
    "LossWeights", "config_params", "loss_spec", "loss_table_markdown", "param", "recipes", "register_loss", "vespo_weights",
]
