"""Where a run is, and a watchdog that says so when it stops moving (``stall_timeout_s``).

The *stage board* is one per process and thread-safe: rollout code marks what it is doing with
``with stage("scoring", function="judge"): ...`` (stages nest; each thread has its own stack), and every stage
that starts or ends, and every optimizer step (:func:`progress`), counts as progress. :class:`Watchdog` checks the
board from a thread of its own: when nothing has progressed for ``stall_s`` seconds it calls ``on_stall`` with a
one-paragraph description of every thread's stages (:func:`describe`), and again after each further ``stall_s``
without progress.

Stages marked by grpokit: ``generation``, ``rollout_func``, ``environment`` (``reset``, with the row), ``tool``
(with its name and row), ``scoring`` (with the reward function), ``behaviour log-probs`` (an asynchronous producer's
pass over what it generated), ``waiting for rollouts`` (the learner of asynchronous rollouts waiting for its producer
thread, which marks its own stages, or for a rollout worker process: with its index, pid and what it is doing),
``starting a rollout worker`` and ``publishing weights``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Stage:
    name: str
    details: dict[str, Any]
    since: float = field(default_factory=time.monotonic)

    def label(self) -> str:
        shown = ", ".join(f"{k} {v}" for k, v in self.details.items() if v is not None)
        return f"{self.name} ({shown})" if shown else self.name


class StageBoard:
    """Each thread's stack of stages, and when anything last progressed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stacks: dict[int, list[_Stage]] = {}
        self._names: dict[int, str] = {}
        self.last_progress = time.monotonic()

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    @contextmanager
    def stage(self, name: str, **details: Any) -> Iterator[None]:
        ident = threading.get_ident()
        entry = _Stage(name, details)
        with self._lock:
            self._stacks.setdefault(ident, []).append(entry)
            self._names[ident] = threading.current_thread().name
            self.last_progress = entry.since
        try:
            yield
        finally:
            with self._lock:
                stack = self._stacks.get(ident, [])
                if entry in stack:
                    stack.remove(entry)
                if not stack:
                    self._stacks.pop(ident, None)
                    self._names.pop(ident, None)
                self.last_progress = time.monotonic()

    def snapshot(self) -> dict[str, list[tuple[str, float]]]:
        """Per thread (by name) its stages, outermost first, each as (label, seconds in it)."""
        now = time.monotonic()
        with self._lock:
            return {f"{self._names.get(i, i)}": [(s.label(), now - s.since) for s in stack]
                    for i, stack in self._stacks.items() if stack}

    def innermost(self, ident: int) -> str | None:
        """The name of the innermost stage thread ``ident`` is in, or None."""
        with self._lock:
            stack = self._stacks.get(ident)
            return stack[-1].name if stack else None

    def describe(self) -> str:
        """Every thread's stages, e.g. ``MainThread: generation > scoring (function 'judge') for 61 s``."""
        threads = self.snapshot()
        if not threads:
            return "no thread is in a rollout stage (the training loop itself: forward, backward, optimizer step, " \
                   "or a collective waiting for another rank)"
        return "; ".join(f"{name}: {' > '.join(label for label, _ in stages)} for {stages[-1][1]:.0f} s"
                         for name, stages in threads.items())


BOARD = StageBoard()
"""The process's stage board."""


def stage(name: str, **details: Any):
    """``with stage("scoring", function="judge"):`` marks a stage on the process's board (:data:`BOARD`)."""
    return BOARD.stage(name, **details)


def progress() -> None:
    """Something finished (an optimizer step): the watchdog's clock restarts."""
    BOARD.progress()


def describe() -> str:
    return BOARD.describe()


class Watchdog:
    """A daemon thread that calls ``on_stall(seconds_without_progress)`` when the board has not progressed for
    ``stall_s`` seconds, and again after each further ``stall_s`` without progress."""

    def __init__(self, stall_s: float, on_stall: Callable[[float], None], board: StageBoard = BOARD,
                 poll_s: float | None = None):
        self.stall_s = stall_s
        self.on_stall = on_stall
        self.board = board
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.05, stall_s / 10))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: tuple[float, float] | None = None

    def start(self) -> None:
        self.board.progress()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="grpokit-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * self.poll_s + 1)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()

    def check(self, now: float | None = None) -> bool:
        """One look at the board (the thread's, every ``poll_s``): call ``on_stall`` if due; whether it was."""
        now = time.monotonic() if now is None else now
        last = self.board.last_progress
        idle = now - last
        if idle < self.stall_s:
            return False
        if self._reported is not None and self._reported[0] == last and idle < self._reported[1] + self.stall_s:
            return False  # this stall was reported less than stall_s ago
        self._reported = (last, idle)
        self.on_stall(idle)
        return True
