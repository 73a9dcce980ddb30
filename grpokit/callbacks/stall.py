"""The watchdog of a training run (``stall_timeout_s``): when nothing progresses for that long (no rollout stage
starts or ends, no optimizer step: :mod:`grpokit.bounds.watchdog`), say which stage every thread is in, on which rank; with
``stall_action="save_and_exit"`` also save a checkpoint and end the process with :data:`STALL_EXIT_CODE`.

A stuck thread cannot be unwound, so the process ends with ``os._exit`` after flushing its output (exit handlers
are not run: one of them could wait for the stuck thread). The checkpoint is written only where it is consistent:
while the training thread of every process is in a rollout stage (its weights and optimizer are then those of the
last optimizer step), with the RNG state that rollout started from, so a resume trains as an uninterrupted run would.
Under several processes the ranks' watchdogs agree and write it through files (grpokit/run/file_rendezvous.py), never a
collective: the training threads are blocked in one. Sharded weights (FSDP, DeepSpeed) need collectives to be
gathered: there none is written, and the latest periodic checkpoint stays.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

from transformers import TrainerCallback

from ..bounds.watchdog import BOARD, Watchdog, describe, progress
from ..run.file_rendezvous import STALL_DIR_PREFIX, FileRendezvous, RendezvousTimeout

logger = logging.getLogger("grpokit")

VOTE_BOUND_S = 60.0
"""Beyond ``stall_timeout_s``, how long a stalled rank waits for the others to say whether a checkpoint is
consistent (their watchdogs fire within ``stall_timeout_s`` of one another)."""
SAVE_BOUND_S = 600.0
"""Beyond ``stall_timeout_s``, how long a stalled rank waits for the others at each step of writing the checkpoint."""

STALL_EXIT_CODE = 124
"""The exit status of a run the watchdog ended (``stall_action="save_and_exit"``), as ``timeout(1)``'s."""

ROLLOUT_STAGES = ("generation", "rollout_func", "environment", "tool", "scoring", "waiting for rollouts", "finishing",
                  "waiting for other ranks")
"""Stages in which the training thread holds the weights of the last optimizer step (a checkpoint is consistent);
``finishing`` and ``waiting for other ranks`` (dynamic sampling's agreement on another round) hold the rollout's
collectives, where the other ranks wait for one stuck in user code."""


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
        done, rendezvous = self._checkpoint()
        self._say(f"grpokit: {done}; exiting with status {STALL_EXIT_CODE} (stall_action='save_and_exit')")
        if rendezvous is not None:  # no rank ends (and has the launcher end the others) before every rank said it
            try:
                rendezvous.wait("said", timeout_s=VOTE_BOUND_S)
            except RendezvousTimeout:
                pass
            rendezvous.close()
        self.exit(STALL_EXIT_CODE)

    def _checkpoint(self) -> tuple[str, FileRendezvous | None]:
        """Save a checkpoint where that is consistent; what happened, in words, and the ranks' rendezvous (None for
        one process) for their last meeting."""
        from ..run.run_dir import latest_checkpoint

        t = self.trainer
        latest = latest_checkpoint(t.args.output_dir)
        keep = f"the latest checkpoint is {latest}" if latest else "there is no earlier checkpoint"
        where = BOARD.innermost(self._training_thread) if self._training_thread is not None else None
        unsafe = None if where in ROLLOUT_STAGES else (
            "the training thread is not in a rollout stage: its weights may be mid-update")
        if t.args.world_size > 1 and (t.is_deepspeed_enabled or t.is_fsdp_enabled):
            unsafe = "sharded weights are gathered by collectives, and the ranks are waiting for one another"
        elif t.args.world_size > 1 and getattr(t.state, "best_global_step", None):
            unsafe = "tracking the best checkpoint (metric_for_best_model) saves through a collective"
        rendezvous = None
        try:
            if t.args.world_size > 1:
                rendezvous, unsafe = self._agree(unsafe)
            if unsafe is not None:
                return f"no checkpoint written ({unsafe}); {keep}", rendezvous
            path = t.save_stalled_checkpoint(rendezvous)
        except RendezvousTimeout as e:  # a rank did not come: no last meeting either
            if rendezvous is not None:
                rendezvous.close()
            return f"no checkpoint written ({e}); {keep}", None
        except Exception as e:  # noqa: BLE001 - the exit must still happen, with the reason said
            return f"the checkpoint could not be written ({type(e).__name__}: {e}); {keep}", rendezvous
        return f"checkpoint saved to {path}; continue with --resume (Python: resume_from_checkpoint='auto')", rendezvous

    def _agree(self, unsafe: str | None) -> tuple[FileRendezvous, str | None]:
        """Several processes: every rank's watchdog says whether its own training thread is at a consistent point
        (a rollout stage, or the rollout's collectives); the checkpoint is written only when all are. They meet
        through files in ``output_dir`` (a collective from this thread would cross the one a training thread is
        blocked in), within ``stall_timeout_s`` plus a minute: each rank's watchdog fires within ``stall_timeout_s``
        of the others'. Returns the rendezvous and the first reason against, by rank."""
        a, step = self.trainer.args, self.trainer.state.global_step
        rendezvous = FileRendezvous(os.path.join(a.output_dir, f"{STALL_DIR_PREFIX}{step}"), a.process_index,
                                    a.world_size, timeout_s=float(a.stall_timeout_s) + SAVE_BOUND_S)
        votes = rendezvous.wait("vote", unsafe or "", timeout_s=float(a.stall_timeout_s) + VOTE_BOUND_S)
        against = [(r, why) for r, why in sorted(votes.items()) if why]
        return rendezvous, (f"rank {against[0][0]}: {against[0][1]}" if against else None)

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
