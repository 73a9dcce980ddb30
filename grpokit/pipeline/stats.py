"""What the pipeline's stages measured, as one typed value: the only channel from the rollout side to the trainer's
log (:meth:`grpokit.GRPOTrainer.record_metric` takes it in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RolloutStats:
    """The metrics of one generation batch, in the order they were measured; a metric measured several times (once per
    dynamic-sampling round) appears several times and is averaged (counters: summed) at log time."""

    metrics: list[tuple[str, float | torch.Tensor]] = field(default_factory=list)
    """``(name, value)`` pairs for the trainer's log."""
    reward_logs: dict[str, list[float]] = field(default_factory=dict)
    """What reward functions logged with ``log_metric`` while scoring, by name: averaged over every process when the
    batch is finished (a collective, so in the learner's thread), then moved into :attr:`metrics`."""
    samples: dict[str, Any] | None = None
    """The batch's prompts, completions, rewards and advantages, for the completions table (``log_completions``)."""
    tokens: int = 0
    """Prompt and completion tokens of a training batch on every process (``num_input_tokens_seen`` grows by it)."""

    def add(self, name: str, value: float | torch.Tensor) -> None:
        self.metrics.append((name, value))

    def log_reward_metric(self, name: str, value: float) -> None:
        """The ``log_metric`` callable reward functions receive."""
        self.reward_logs.setdefault(str(name), []).append(float(value))

    def merge(self, other: RolloutStats) -> RolloutStats:
        """This batch's stats followed by ``other``'s (a later stage's)."""
        logs = {k: list(v) for k, v in self.reward_logs.items()}
        for k, v in other.reward_logs.items():
            logs.setdefault(k, []).extend(v)
        return RolloutStats(metrics=self.metrics + other.metrics, reward_logs=logs,
                            samples=other.samples if other.samples is not None else self.samples,
                            tokens=self.tokens + other.tokens)
