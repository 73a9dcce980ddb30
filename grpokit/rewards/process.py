"""Reward functions in a process of their own (``reward_process=True``): the trainer's side.

In the trainer's process a reward function shares its memory (one that allocates without bound takes the trainer
down with it), its GIL (Python-heavy scoring stalls the step) and its fate (a call that hangs can only be abandoned,
never ended). :class:`RewardProcess` runs the user's reward functions in one child process
(:mod:`grpokit.rewards.process_child`) with a memory limit (``worker_memory_mb``); each function is replaced by a
:class:`ProcessReward` that scores through it, under the same time bound (``reward_timeout_s``):

- a call that passes the bound is *ended*: the process is killed and started again before the next call, and the
  timeout is counted and said as in the trainer's process (``rewards/<name>/timeout_total``);
- a call that runs out of memory (a ``MemoryError`` at the limit), or whose process dies (the kernel's OOM killer, a
  crash in C code), counts as failed: its rows get ``None`` from that function, ``rewards/<name>/failed_total``
  counts it, one warning names it, and the process is started again; the trainer goes on unaffected;
- a function that raises stops the run with the same :class:`~grpokit.rewards.scoring.RewardFunctionError` (the
  row named) as in the trainer's process.

A function gets the same keyword arguments as in the trainer's process, except that ``trainer_state`` is a plain
copy of its fields (a ``SimpleNamespace``: ``global_step``, ``max_steps``, ``epoch``, ...), so that the process
does not import transformers and torch for it (they would take a few hundred MB of its limit and seconds of each
restart); ``log_metric`` and ``log_extra`` work as usual (what they log is replayed in the trainer).

Functions cross by ``dill`` pickling (plain functions, lambdas, closures over plain data, objects whose state
pickles); one that cannot cross is refused when the trainer is made, in one line naming it and why. The process is
stopped when training ends, with the trainer on every exit path (``atexit``; the kernel's parent-death signal on a
``SIGKILL``), and started again lazily if scoring is needed after that (an evaluation).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import select
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

from ..bounds.user_calls import CallBounds, CallTimeout, Incidents
from .process_child import HEADER
from .registry import reward_func_name

logger = logging.getLogger("grpokit")

START_TIMEOUT_S = 300.0
"""How long the process may take to start and load the reward functions (imports included) before the run stops
with that as its error: a hang guard, far above the seconds it takes."""

NOT_SENT = ("log_metric", "log_extra")
"""Keyword arguments that stay in the trainer: the process gets its own and replays what they logged."""


class RewardProcessError(RuntimeError):
    """The reward process could not start or load the reward functions (one line: what and why)."""


def default_memory_mb() -> int:
    """A quarter of the machine's physical memory, in MB."""
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return max(256, pages * page_size // 4 // 2**20)


def check_picklable(funcs: list) -> None:
    """Every function must cross into the reward process: a ValueError naming the first that cannot, and why."""
    import dill

    for i, func in enumerate(funcs):
        try:
            dill.dumps(func, recurse=True)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the user's to see, in one line
            raise ValueError(
                f"reward_funcs[{i}] ({reward_func_name(func)!r}) cannot cross into the reward process "
                f"(reward_process=True): {type(e).__name__}: {e}. A reward function there must pickle: a plain "
                "function, a lambda or a closure over plain data, not one holding a socket, a client connection or a "
                "generator (open those inside the function), or set reward_process=False") from None


class RewardProcess:
    """One child process that holds the reward functions and scores with them, one call at a time."""

    def __init__(self, funcs: list, memory_mb: int | None):
        import dill

        self.blob = dill.dumps(funcs, recurse=True)
        self.memory_mb = memory_mb
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.starts = 0
        self._lock = threading.Lock()
        atexit.register(self.close)

    # -- lifetime ----------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "grpokit.rewards.process_child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.starts += 1
        limit = None if self.memory_mb is None else int(self.memory_mb) * 2**20
        try:
            self._send(("init", self.blob, list(sys.path), limit))
            answer = self._receive(time.monotonic() + START_TIMEOUT_S)
        except (CallTimeout, BrokenPipeError) as e:
            self.close()
            raise RewardProcessError(f"the reward process did not start: {e}") from None
        if answer is None or answer[0] != "ready":
            why = answer[1] if answer else f"it ended with status {self.proc.wait()}"
            self.close()
            raise RewardProcessError(f"the reward process did not start: {why}")
        self.pid = answer[1]

    def close(self) -> None:
        """Stop the process (if it runs); the next call starts a fresh one."""
        proc, self.proc, self.pid = self.proc, None, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    # -- calls -------------------------------------------------------------------------------------------------------
    def call(self, index: int, kwargs: dict[str, Any], timeout_s: float | None, what: str, where: str) -> tuple:
        """The answer of function ``index`` on ``kwargs``: ``("ok", values, metrics, extras)``, ``("error",
        message)`` or ``("failed", why)`` (out of memory, or the process died: it is restarted before the next
        call). Past ``timeout_s`` the process is killed and :class:`CallTimeout` raised."""
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self.close()
                self._start()
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            try:
                self._send(("call", index, kwargs))
                answer = self._receive(deadline)
            except CallTimeout:
                self.close()
                raise CallTimeout(what, timeout_s, where, reason=f"did not return within {timeout_s:g} s (its "
                                  "process was ended and is started again)") from None
            except BrokenPipeError:
                answer = None
            if answer is None:
                status = self.proc.wait() if self.proc is not None else None
                self.close()
                return ("failed", f"the reward process ended ({_status(status)})")
            if answer[0] == "memory":
                self.close()
                return ("failed", f"it ran out of memory (worker_memory_mb={self.memory_mb}: {answer[1]})")
            return answer

    def _send(self, message: Any) -> None:
        import dill

        payload = dill.dumps(message)
        self.proc.stdin.write(HEADER.pack(len(payload)) + payload)
        self.proc.stdin.flush()

    def _receive(self, deadline: float | None) -> Any:
        """One frame, or None when the process's output ended; :class:`CallTimeout` (bare) past ``deadline``."""
        import dill

        header = self._read(HEADER.size, deadline)
        if header is None:
            return None
        payload = self._read(HEADER.unpack(header)[0], deadline)
        return None if payload is None else dill.loads(payload)

    def _read(self, n: int, deadline: float | None) -> bytes | None:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < n:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                raise CallTimeout("the reward process", None, reason="did not answer in time")
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        name = signal.Signals(-code).name
        return f"killed by {name}" + (": the kernel's out-of-memory killer, most likely" if name == "SIGKILL" else "")
    return f"status {code}"


class ProcessReward:
    """A user's reward function as the trainer calls it with ``reward_process=True``: bounded by the scorer
    (``score_bounded``, as an environment's reward is), run in :class:`RewardProcess`."""

    def __init__(self, func: Any, index: int, process: RewardProcess):
        self.__name__ = reward_func_name(func)
        self.index, self.process = index, process

    def __call__(self, **kwargs) -> list:
        return self.score_bounded(kwargs, CallBounds(reward_timeout_s=None), Incidents())

    def score_bounded(self, kwargs: dict[str, Any], bounds: CallBounds, incidents: Incidents) -> list:
        from .scoring import RewardFunctionError, batch_where, reward_timed_out

        name, n = self.__name__, len(kwargs["completions"])
        where = batch_where(kwargs.get("prompts"), n)
        sent = {k: v for k, v in kwargs.items() if k not in NOT_SENT}
        if dataclasses.is_dataclass(sent.get("trainer_state")):  # its fields, without transformers' class: the
            sent["trainer_state"] = SimpleNamespace(**dataclasses.asdict(sent["trainer_state"]))  # process stays light
        try:
            answer = self.process.call(self.index, sent, bounds.reward_timeout_s, f"reward function {name!r}", where)
        except CallTimeout as e:
            reward_timed_out(e, name, bounds, incidents)
            return [None] * n
        if answer[0] == "error":
            raise RewardFunctionError(answer[1])
        if answer[0] == "failed":
            incidents.count(f"rewards/{name}/failed_total")
            logger.warning("grpokit: reward function %r failed in the reward process%s: %s; it counts as None there, "
                           "the process is started again and the run goes on", name, where, answer[1])
            return [None] * n
        _, values, metrics, extras = answer
        for key, fn in (("log_metric", metrics), ("log_extra", extras)):
            if callable(kwargs.get(key)):
                for args in fn:
                    kwargs[key](*args)
        return values
