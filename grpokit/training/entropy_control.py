"""The entropy bonus the trainer adds to the loss (TRL's ``entropy_coef``), with the adaptive controller of
``use_adaptive_entropy`` as state: the controller and the entropy measured over the current optimizer step. The
formulas are :func:`grpokit.algorithms.entropy.entropy_bonus` and :class:`grpokit.algorithms.entropy.AdaptiveEntropyCoef`.
A checkpoint part (grpokit/run/checkpoint_parts.py) under TRL's file name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..algorithms.entropy import AdaptiveEntropyCoef, entropy_bonus
from ..algorithms.masks import high_entropy_mask


class EntropyBonus:
    checkpoint_file = "entropy_ctrl_state.json"

    def __init__(self, args):
        self.args = args
        self.controller = AdaptiveEntropyCoef(
            coef=args.entropy_coef, target=args.entropy_target, delta=args.entropy_coef_delta, lo=args.entropy_coef_min,
            hi=args.entropy_coef_max) if args.use_adaptive_entropy else None
        self._window: torch.Tensor | None = None  # (Σ m·H, Σ m) of this optimizer step's micro-batches so far

    @property
    def enabled(self) -> bool:
        return self.args.entropy_coef != 0.0 or self.controller is not None

    @property
    def coef(self) -> float:
        """The controller's current coefficient with ``use_adaptive_entropy``, else ``entropy_coef``."""
        return self.controller.coef if self.controller is not None else self.args.entropy_coef

    def term(self, policy_term: torch.Tensor, entropies: torch.Tensor, mask: torch.Tensor, ga: int, mode: str,
             gather, *, end_of_step: bool, sum_over_processes: Callable[[torch.Tensor], torch.Tensor],
             record: Callable[[str, Any], None], policy_term_scale: int) -> torch.Tensor:
        """The bonus of one micro-batch on the tokens the policy term acts on (the high-entropy mask too when
        ``top_entropy_quantile`` < 1), at the coefficient of this optimizer step; with the controller, the step's
        entropy over every process updates the coefficient for the next one (``end_of_step``: this micro-batch ends the
        optimizer step). Records ``policy_loss`` (the policy term alone, times ``policy_term_scale``, as TRL reports
        it) and ``entropy_coef``."""
        a = self.args
        if a.top_entropy_quantile < 1.0:
            mask = mask * high_entropy_mask(entropies, mask, a.top_entropy_quantile, gather)
        coef = self.controller.applied() if self.controller is not None else a.entropy_coef
        record("policy_loss", policy_term.detach() * policy_term_scale)
        if self.controller is not None and mode == "train":
            stats = torch.stack([(entropies.detach() * mask).sum(), mask.sum()])
            self._window = stats if self._window is None else self._window + stats
            if end_of_step:
                total = sum_over_processes(self._window)
                self.controller.update((total[0] / total[1].clamp(min=1.0)).item())
                self._window = None
        if mode == "train" and end_of_step:
            record("entropy_coef", self.controller.coef if self.controller is not None else coef)
        return entropy_bonus(entropies, mask, coef, ga)

    def state_dict(self) -> dict[str, float] | None:
        return self.controller.state_dict() if self.controller is not None else None

    def load_state_dict(self, state: dict[str, float]) -> None:
        if self.controller is not None:
            self.controller.load_state_dict(state)
