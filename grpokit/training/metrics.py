"""The trainer's metrics between two log lines: one store that the loss, the rollout pipeline's
:class:`grpokit.pipeline.RolloutStats` and the callbacks all record into, reduced when a line is logged."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..pipeline.stats import RolloutStats


def reduce_metrics(values_by_key: dict[str, list]) -> dict[str, float]:
    """Each metric's values since the last log — over micro-steps, then over ranks (tensors converted here, at log
    time: no host sync per micro-step), NaNs skipped: the mean; counters (``skipped_nonfinite``, ``..._total``)
    summed; keys named ``.../min``, ``..._min`` (``max``) take the extreme."""
    out = {}
    for key, values in values_by_key.items():
        nums = [float(v.item()) if isinstance(v, torch.Tensor) else float(v) for v in values]
        nums = [v for v in nums if v == v]
        if not nums:
            continue
        if key == "skipped_nonfinite" or key.endswith("_total"):
            out[key] = sum(nums)
        elif key.endswith(("/min", "_min")):
            out[key] = min(nums)
        elif key.endswith(("/max", "_max")):
            out[key] = max(nums)
        else:
            out[key] = sum(nums) / len(nums)
    return out


class MetricsStore:
    """Values recorded since the last log line, per mode (``"train"``, ``"eval"``)."""

    def __init__(self):
        self.values: dict[str, dict[str, list]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def record(self, name: str, value: float | torch.Tensor, mode: str = "train") -> None:
        self.values[mode][name].append(value)

    def record_stats(self, stats: RolloutStats, mode: str) -> None:
        for name, value in stats.metrics:
            self.record(name, value, mode)

    def take(self, mode: str, gather_objects=None) -> dict[str, float]:
        """The reduced values of ``mode`` (over every process with ``gather_objects``, which gathers a Python object
        from each), and a fresh start."""
        metrics = reduce_metrics(self.values[mode])
        if gather_objects is not None:  # every rank logs at the same steps: reduce over ranks
            per_rank = gather_objects([metrics])
            metrics = reduce_metrics({k: [m[k] for m in per_rank if k in m] for k in set().union(*per_rank)})
        self.values[mode].clear()
        return metrics
