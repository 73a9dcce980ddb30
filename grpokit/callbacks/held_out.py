"""Held-out accuracy during training: the job's evaluation run every ``every_steps`` optimizer steps, its numbers
written into ``metrics.jsonl`` (``heldout/*`` keys, plotted as ``heldout_accuracy.png``) and said in one line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from ..reporting._util import HELD_OUT_KEYS
from ..validation import refusal


def held_out_record(summary: dict[str, Any]) -> dict[str, float]:
    """The ``heldout/*`` metrics of an evaluation summary (:func:`grpokit.evaluation.evaluate`'s first value)."""
    record = {"heldout/reward_mean": float(summary["reward_mean"])}
    if summary.get("accuracy") is not None:
        record.update(zip(HELD_OUT_KEYS, map(float, (summary["accuracy"], *summary["accuracy_ci95"]))))
    return record


class HeldOutCurve(TrainerCallback):
    """After every ``every_steps``-th optimizer step, ``evaluate(model)`` (the job's held-out evaluation, which
    restores the training mode) and hand its summary to ``on_result(step, summary)``. Skipped on the step training
    stops at: the job's evaluation after training measures that one. Add it after :class:`TimeBudget`, so that
    the stop is already decided."""

    def __init__(self, every_steps: int, evaluate: Callable[[Any], dict[str, Any]],
                 on_result: Callable[[int, dict[str, Any]], None]):
        if every_steps < 1:
            raise refusal("every_steps", every_steps, "expected a positive integer")
        self.every_steps = every_steps
        self.evaluate = evaluate
        self.on_result = on_result

    def on_step_end(self, args, state, control, model=None, **kw):
        step = state.global_step
        last = control.should_training_stop or (state.max_steps and step >= state.max_steps)
        if model is None or step % self.every_steps or last:
            return control
        self.on_result(step, self.evaluate(model))
        return control
