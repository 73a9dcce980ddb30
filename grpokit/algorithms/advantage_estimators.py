"""The advantage estimator registry (``advantage_estimator``): how the aggregated rewards ``R`` of a generation batch
become one advantage per completion. As with the losses, an estimator is described once — one function and one
``register_advantage_estimator(AdvantageEstimator(...))`` — and ``GRPOConfig``'s choices and validation read the
registry. :func:`grpokit.algorithms.advantages.group_advantages` applies the rules every estimator shares (NaN rows
and, unless ``ties_teach``, groups whose completions all scored alike get exactly 0).

Rows are ordered by group: the ``G`` completions of one prompt are consecutive. ``R`` is NaN for a row every reward
function skipped; every mean and spread skips it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .masked import nanstd
from .registry_names import LiveNames

STD_EPS = 1e-4
"""Added to a standard deviation before dividing by it."""


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    formula: str
    """One line: the advantage ``A_i`` it computes."""
    reference: str
    advantages: Callable[[torch.Tensor, int, str], torch.Tensor]
    """``(R, G, scale_rewards) -> A``: ``R`` (N,), ``scale_rewards`` one of ``"group"``, ``"batch"``, ``"none"``."""
    ties_teach: bool = False
    """A group whose completions all scored alike keeps its advantage (its baseline is not the group's own mean)."""


ADVANTAGE_ESTIMATOR_REGISTRY: dict[str, AdvantageEstimator] = {}
ADVANTAGE_ESTIMATORS: Sequence[str] = LiveNames(ADVANTAGE_ESTIMATOR_REGISTRY)
"""The registered ``advantage_estimator`` names, read at each use."""


def register_advantage_estimator(spec: AdvantageEstimator) -> AdvantageEstimator:
    """Add an estimator; a name taken by another estimator is an error."""
    taken = ADVANTAGE_ESTIMATOR_REGISTRY.get(spec.name)
    if taken is not None and taken is not spec:
        raise ValueError(f"an advantage estimator named {spec.name!r} is already registered")
    ADVANTAGE_ESTIMATOR_REGISTRY[spec.name] = spec
    return spec


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in ADVANTAGE_ESTIMATOR_REGISTRY:
        raise ValueError(f"advantage_estimator={name!r} is not supported; allowed: "
                         f"{', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATOR_REGISTRY[name]


def _scaled(adv: torch.Tensor, total: torch.Tensor, grouped: torch.Tensor, g: int, scale: str,
            groups: bool) -> torch.Tensor:
    """``adv`` divided by the spread ``scale_rewards`` asks for: the group's (``"group"``, when ``groups``), the
    batch's (``"batch"``, and ``"group"`` without groups), or none."""
    if scale == "group" and groups:
        std = nanstd(grouped, dim=1, keepdim=True).expand(-1, g).reshape(-1)
    elif scale != "none":
        std = nanstd(total) if total.numel() > 1 else total.new_zeros(())
    else:
        return adv
    return adv / (torch.nan_to_num(std, nan=0.0) + STD_EPS)


def grpo_advantages(total: torch.Tensor, g: int, scale: str) -> torch.Tensor:
    """GRPO (arXiv 2402.03300 §4.1.2): ``A_i = (R_i - mean_g R) / (std R + 1e-4)``, the spread of the group
    (``"group"``), of the batch (``"batch"``) or none (``"none"``: Dr. GRPO, arXiv 2503.20783)."""
    grouped = total.view(-1, g)
    adv = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
    return _scaled(adv, total, grouped, g, scale, groups=True)


def rloo_advantages(total: torch.Tensor, g: int, scale: str) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): ``A_i = R_i - mean_{j≠i} R_j`` over the group's other scorable completions, unscaled;
    0 in a group with fewer than two."""
    grouped = total.view(-1, g)
    valid = (~torch.isnan(grouped)).to(total.dtype)
    count = valid.sum(1, keepdim=True)
    others = (torch.nansum(grouped, 1, keepdim=True) - torch.nan_to_num(grouped, nan=0.0)) / (count - 1).clamp(min=1.0)
    adv = (grouped - others).view(-1)
    return torch.where((count < 2).repeat_interleave(g, 1).view(-1), torch.zeros_like(adv), adv)


def reinforce_plus_plus_advantages(total: torch.Tensor, g: int, scale: str) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262, global advantage normalisation): ``A_i = (R_i - mean_batch R) / (std_batch R +
    1e-4)`` over every completion of the batch, the groups ignored (``scale_rewards="none"``: centred only). The
    statistics are over completions (verl's whitens over tokens: the same for equal lengths)."""
    grouped = total.view(-1, g)
    adv = (grouped - torch.nanmean(total)).view(-1)
    return _scaled(adv, total, grouped, g, scale, groups=False)


register_advantage_estimator(AdvantageEstimator(
    "grpo", "(R - mean_group R) / (std R + 1e-4), std of the group / batch / none (scale_rewards)",
    "GRPO, arXiv 2402.03300; Dr. GRPO (scale_rewards='none'), arXiv 2503.20783", grpo_advantages))
register_advantage_estimator(AdvantageEstimator(
    "rloo", "R_i - mean of the group's other completions' R", "RLOO, arXiv 2402.14740", rloo_advantages))
register_advantage_estimator(AdvantageEstimator(
    "reinforce_plus_plus", "(R - mean_batch R) / (std_batch R + 1e-4): a tied group still teaches",
    "REINFORCE++, arXiv 2501.03262", reinforce_plus_plus_advantages, ties_teach=True))
