"""The terminal display of a run: a live rich progress bar and one readable line per log step."""

from __future__ import annotations

import atexit
import math
import sys
import time
import weakref

from transformers import TrainerCallback

from ..reporting._util import fmt_duration, to_float


def _num(logs: dict, key: str) -> float | None:
    v = to_float(logs.get(key)) if key in logs else None
    return v if v is not None and math.isfinite(v) else None


def _g(v: float, digits: int = 3) -> str:
    """Compact float: fixed-point when readable, scientific for tiny non-zero values."""
    if v != 0 and abs(v) < 10 ** (-digits):
        return f"{v:.1e}"
    return f"{v:.{digits}f}"


def format_log_line(logs: dict, step: int, max_steps: int | None,
                    sec_per_step: float | None = None, eta_s: float | None = None) -> str:
    """One human-readable line for a training log event (only keys present are shown)."""
    parts = [f"step {step}/{max_steps}" if max_steps else f"step {step}"]
    reward = _num(logs, "reward")
    if reward is not None:
        std = _num(logs, "reward_std")
        parts.append(f"reward {reward:.3f}" + (f" ± {std:.2f}" if std is not None else ""))
    elif (std := _num(logs, "reward_std")) is not None:
        parts.append(f"reward_std {std:.2f}")
    if (v := _num(logs, "completions/mean_length")) is not None:
        parts.append(f"len {v:.1f}")
    if (v := _num(logs, "loss")) is not None:
        parts.append(f"loss {v:.4g}" if v != 0 and abs(v) >= 1e-4 else f"loss {_g(v, 4)}")
    if (v := _num(logs, "kl")) is not None:
        parts.append(f"kl {_g(v, 3)}")
    if (v := _num(logs, "clip_ratio/region_mean")) is not None:
        parts.append(f"clip {v:.2f}")
    if (v := _num(logs, "vespo/phi_seq_mean")) is not None:
        parts.append(f"phi {v:.3f}")
    if (v := _num(logs, "entropy")) is not None:
        parts.append(f"entropy {v:.3f}")
    step_time = _num(logs, "step_time")
    if step_time is None:
        step_time = sec_per_step
    if step_time is not None:
        parts.append(f"{step_time:.1f} s/step")
    if eta_s is not None and max_steps and step < max_steps:
        parts.append(f"ETA {fmt_duration(eta_s)}")
    return " | ".join(parts)


def _stdout_is_tty() -> bool:
    try:
        return bool(sys.stdout.isatty())
    except (AttributeError, ValueError):
        return False


_LIVE_PROGRESSES: weakref.WeakSet[ProgressCallback] = weakref.WeakSet()


@atexit.register
def _stop_live_progresses() -> None:  # restore the terminal if training crashed mid-bar
    for cb in list(_LIVE_PROGRESSES):
        cb._stop_bar()


class ProgressCallback(TrainerCallback):
    """Live rich progress bar (step/max_steps, reward, mean completion length, elapsed, ETA) plus one
    readable line per logging step, e.g.::

        step 12/95 | reward 0.742 ± 0.31 | len 23.1 | loss -0.0012 | kl 0.000 | clip 0.00 | 6.1 s/step | ETA 8m12s

    ``quiet=True`` or a non-TTY stdout: no bar, only the log lines (plain ``print``). Only the
    world-process-zero prints. Use it *instead of* transformers' ``PrinterCallback``/``ProgressCallback``.
    """

    def __init__(self, quiet: bool = False, time_budget_s: float | None = None):
        self.quiet = quiet
        self.time_budget_s = time_budget_s  # a run stopped by time: the ETA is the smaller of steps and time
        self._progress = None
        self._task = None
        self._t0: float | None = None
        self._start_step = 0
        self._max_steps = 0

    # -- bar management ---------------------------------------------------------------------------
    def _start_bar(self, state) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold cyan]train"),
            BarColumn(bar_width=None),
            MofNCompleteColumn(),
            TextColumn("reward [bold]{task.fields[reward]}"),
            TextColumn("len {task.fields[length]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(),
            refresh_per_second=2,
            speed_estimate_period=300,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=state.max_steps or None,
                                             completed=state.global_step, reward="–", length="–")
        self._progress.start()
        _LIVE_PROGRESSES.add(self)

    def _stop_bar(self) -> None:
        if self._progress is not None:
            try:
                self._progress.stop()
            finally:
                self._progress = None
                self._task = None
                _LIVE_PROGRESSES.discard(self)

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)

    # -- timing -----------------------------------------------------------------------------------
    def _sec_per_step(self, step: int) -> float | None:
        if self._t0 is None or step <= self._start_step:
            return None
        return (time.perf_counter() - self._t0) / (step - self._start_step)

    # -- callback hooks ---------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()
        self._start_step = state.global_step
        self._max_steps = state.max_steps
        if state.is_world_process_zero and not self.quiet and _stdout_is_tty():
            self._stop_bar()
            self._start_bar(state)

    def on_step_end(self, args, state, control, **kwargs):
        if self._progress is not None and state.is_world_process_zero:
            self._progress.update(self._task, completed=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        step, max_steps = state.global_step, state.max_steps or self._max_steps
        if self._progress is not None:
            fields = {}
            if (r := _num(logs, "reward")) is not None:
                fields["reward"] = f"{r:.3f}"
            if (n := _num(logs, "completions/mean_length")) is not None:
                fields["length"] = f"{n:.1f}"
            if fields:
                self._progress.update(self._task, completed=step, **fields)

        if "train_runtime" in logs:  # end-of-training summary from Trainer
            parts = [f"done: {step} steps in {fmt_duration(_num(logs, 'train_runtime'))}"]
            if (v := _num(logs, "train_loss")) is not None:
                parts.append(f"train_loss {v:.4g}")
            self._print(" | ".join(parts))
            return
        eval_keys = [k for k in logs if k.startswith("eval_") and _num(logs, k) is not None]
        if eval_keys and not any(k in logs for k in ("loss", "reward")):
            shown = ", ".join(f"{k[5:]} {_num(logs, k):.4g}" for k in eval_keys[:8])
            self._print(f"eval @ step {step} | {shown}")
            return
        sps = self._sec_per_step(step)
        eta = None
        if max_steps and step < max_steps:
            per = sps if sps is not None else _num(logs, "step_time")
            eta = None if per is None else per * (max_steps - step)
            if self.time_budget_s is not None and self._t0 is not None:
                left = max(0.0, self.time_budget_s - (time.perf_counter() - self._t0))
                eta = left if eta is None else min(eta, left)
        self._print(format_log_line(logs, step, max_steps, sec_per_step=sps, eta_s=eta))

    def on_train_end(self, args, state, control, **kwargs):
        if self._progress is not None:
            self._progress.update(self._task, completed=state.global_step)
        self._stop_bar()
