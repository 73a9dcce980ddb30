"""The watchdog of a training run (``stall_timeout_s``): when nothing progresses for that long (no rollout stage
starts or ends, no optimizer step: :mod:`grpokit.watchdog`), say which stage every thread is in, on which rank; with
``stall_action="save_and_exit"`` also save a checkpoint and end the process with :data:`STALL_EXIT_CODE`.

A stuck thread cannot be unwound, so the process ends with ``os._exit`` after flushing its output (exit handlers
are not run: one of them could wait for the stuck thread). The checkpoint is written only where it is consistent
and possible: on a single process, while the training thread is in a rollout stage (its weights are then those of
the last optimizer step). Under several processes none is written (a checkpoint needs every rank, and the ranks are
waiting for one another); the latest periodic checkpoint stays, and ``--resume`` continues from it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

from transformers import TrainerCallback

from ..watchdog import BOARD, Watchdog, describe, progress

logger = logging.getLogger("grpokit")

STALL_EXIT_CODE = 124
"""The exit status of a run the watchdog ended (``stall_action="save_and_exit"``), as ``timeout(1)``'s."""

ROLLOUT_STAGES = ("generation", "rollout_func", "environment", "tool", "scoring", "waiting for rollouts")
"""Stages in which the training thread holds the weights of the last optimizer step (a checkpoint is consistent)."""


class StallWatchdog(TrainerCallback):
    """Runs a :class:`grpokit.Watchdog` while ``train()`` runs; ``exit`` ends the process (a test passes
    its own)."""

    def __init__(self, trainer, exit: Callable[[int], None] = os._exit):
        """``exit``: how the process ends after a stall it was asked to end on (``os._exit``; a test passes its own)."""
        self.trainer = trainer
        self.exit = exit
        self.dog: Watchdog | None = None
        self._training_thread: int | None = None
        self.reports: list[str] = []

    def on_train_begin(self, args, state, control, **kw):
        self.stop()
        self._training_thread = threading.get_ident()
        self.dog = Watchdog(float(args.stall_timeout_s), self.stalled)
        self.dog.start()

    def on_step_end(self, args, state, control, **kw):
        progress()

    def stop(self) -> None:
        """Stop watching (the end of training, normal or not)."""
        if self.dog is not None:
            self.dog.stop()
            self.dog = None

    def stalled(self, idle_s: float) -> None:
        t, a = self.trainer, self.trainer.args
        line = (f"grpokit: no progress for {idle_s:.0f} s (stall_timeout_s={a.stall_timeout_s:g}) at step "
                f"{t.state.global_step}, rank {a.process_index} of {a.world_size}: {describe()}")
        self._say(line)
        if a.stall_action != "save_and_exit":
            return
        self._say(f"grpokit: {self._checkpoint()}; exiting with status {STALL_EXIT_CODE} (stall_action="
                  "'save_and_exit')")
        self.exit(STALL_EXIT_CODE)

    def _checkpoint(self) -> str:
        """Save a checkpoint where that is consistent; what happened, in words."""
        from ..run_dir import latest_checkpoint

        t = self.trainer
        latest = latest_checkpoint(t.args.output_dir)
        keep = f"the latest checkpoint is {latest}" if latest else "there is no earlier checkpoint"
        if t.args.world_size > 1:
            return (f"no checkpoint written (under {t.args.world_size} processes a checkpoint needs every rank, and "
                    f"they are waiting for one another); {keep}")
        where = BOARD.innermost(self._training_thread) if self._training_thread is not None else None
        if where not in ROLLOUT_STAGES:
            return f"no checkpoint written (the training thread is not in a rollout stage: its weights may be " \
                   f"mid-update); {keep}"
        try:
            path = t.save_checkpoint()
        except Exception as e:  # noqa: BLE001 - the exit must still happen, with the reason said
            return f"the checkpoint could not be written ({type(e).__name__}: {e}); {keep}"
        return f"checkpoint saved to {path}; continue with --resume (Python: resume_from_checkpoint='auto')"

    def _say(self, line: str) -> None:
        self.reports.append(line)
        print(line, file=sys.stderr, flush=True)
        for handler in logging.getLogger().handlers + logger.handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the report
                pass
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
