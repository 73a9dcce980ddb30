"""Entropy regularisation (TRL's ``entropy_coef``) and its adaptive controller (``use_adaptive_entropy``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, coef: float, gradient_accumulation_steps: int = 1,
                  ) -> torch.Tensor:
    """The term added to the loss: ``-coef · Σ m·H / max(1, Σ m) / GA`` — maximise the mean token entropy ``H``
    of the tokens ``m`` marks (the loss mask, times the high-entropy mask when ``top_entropy_quantile < 1``, so the
    bonus acts on the tokens the policy term acts on), scaled for gradient accumulation only, whatever the policy
    loss's normaliser."""
    mean_h = (entropies * mask).sum() / mask.sum().clamp(min=1.0)
    return -coef * mean_h / gradient_accumulation_steps


@dataclass
class AdaptiveEntropyCoef:
    """The adaptive entropy controller of Skywork-OR1 (arXiv 2505.22312), as TRL implements it.

    The bonus applies ``coef`` only while the entropy measured over the previous optimizer step is at most
    ``target``; at the end of each optimizer step, with that step's token-weighted mean entropy ``H`` over every
    rank, ``coef += delta`` if ``H ≤ target`` else ``coef -= delta``, kept within ``[lo, hi]``. Before the first
    step nothing has been measured (``H = inf``), so the bonus starts off.
    """

    coef: float
    target: float
    delta: float
    lo: float
    hi: float
    last_entropy: float = math.inf

    def applied(self) -> float:
        """The coefficient this optimizer step's micro-batches use."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, step_entropy: float) -> None:
        """End of an optimizer step: move ``coef`` by ``delta`` toward keeping the entropy above ``target``."""
        if step_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.hi)
        else:
            self.coef = max(self.coef - self.delta, self.lo)
        self.last_entropy = step_entropy

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["entropy_coef"])
        self.last_entropy = float(state["last_world_entropy"])
