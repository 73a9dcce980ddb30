"""Time bounds on calls into user code during a rollout (reward functions, judges, ``rollout_func``, tools,
environments): a call that does not return within its bound is a :class:`CallTimeout` naming the function, the
rows and the time, never a frozen run.

How a call is bounded. A Python thread cannot be interrupted from outside (a reward stuck in a socket read, a tool in
an endless loop), so a bounded call runs in a *daemon* thread of its own and the caller waits at most the bound for
it. When the bound passes, the caller raises :class:`CallTimeout` and *abandons* the call: the thread keeps running
in the background until the user code returns by itself (if ever), its result or error is discarded, and it holds
whatever it allocated and, if it computes, a share of the CPU (and of Python's GIL) until then. Daemon threads never
keep the process alive at exit. Coroutines (``async`` rewards and tools) are cancelled at their bound when they
await; one that blocks its event loop (a synchronous wait inside ``async def``) is abandoned like a thread, with
every coroutine on that loop.

Two guards keep abandoned calls from piling up:

* an object whose call was abandoned (the ``owner`` of the call: an environment instance) is *busy* while that
  call still runs: further calls on it are refused at once (a :class:`CallTimeout` saying so) instead of running
  beside the abandoned one, and :func:`is_busy` tells its owner to make a fresh one (reward functions and
  ``tools=`` have no owner: they are called concurrently anyway);
* at most :data:`MAX_ABANDONED` abandoned calls may be running at once; past that, bounded calls are refused at once
  (counted as timeouts) until some of them end.

``timeout_s=None`` calls the function directly in the caller's thread (no thread, no bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_ABANDONED = 64
"""Abandoned calls that may still be running at once; past that, bounded calls are refused (each refusal is a
timeout of its own) until some end."""

ASYNC_GRACE_S = 1.0
"""Coroutines are cancelled at their bound; an event loop that a coroutine blocks (a synchronous sleep inside
``async def``) gets this much longer before it is abandoned."""

REWARD_TIMEOUT_ACTIONS = ("none", "stop")
"""What a reward function that passes ``reward_timeout_s`` means: ``"none"``, its rows get ``None`` from it (not
applicable, as if the function had returned ``None``); ``"stop"``, the run stops with the cause, on every rank."""

STOPPING = "an earlier call that timed out asked for a stop (no more user code is called)"
"""The stop a batch carries when its user code was skipped because the run is stopping."""

_lock = threading.Lock()
_abandoned: dict[int, tuple[str, float]] = {}
"""Running abandoned calls: thread id → (what, when abandoned)."""
_busy: dict[int, int] = {}
"""id(owner) → how many of its calls are abandoned and still running."""


class RunStopped(RuntimeError):
    """The run stopped because a call into user code passed its bound and the config asks for a stop
    (``reward_timeout_action="stop"``, or a ``rollout_func`` that timed out); under data parallelism every rank
    raises it, naming the rank that stopped."""


class CallTimeout(RuntimeError):
    """A call into user code did not return within its bound (or was refused because earlier ones still run)."""

    def __init__(self, what: str, seconds: float | None, where: str = "", *, reason: str | None = None):
        self.what, self.seconds, self.where, self.reason = what, seconds, where, reason
        text = reason or f"did not return within {seconds:g} s"
        super().__init__(f"{what} {text}{where}")


@dataclass
class CallBounds:
    """The bounds of one run (from :class:`grpokit.GRPOConfig`: :meth:`from_config`) and its stop flag.

    The flag is set when a bound passes and the run must stop (``reward_timeout_action="stop"``, or a
    ``rollout_func`` that timed out): scoring then calls no more user code, and the trainer stops every rank after
    the batch (:func:`grpokit.bounds.process_group.stop_together`)."""

    reward_timeout_s: float | None = 300.0
    reward_timeout_action: str = "none"
    tool_timeout_s: float | None = 60.0
    max_tool_result_chars: int | None = 16384
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    @classmethod
    def from_config(cls, args) -> CallBounds:
        return cls(reward_timeout_s=args.reward_timeout_s, reward_timeout_action=args.reward_timeout_action,
                   tool_timeout_s=args.tool_timeout_s, max_tool_result_chars=args.max_tool_result_chars)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        self._stopping.set()

    def clear_stop(self) -> None:
        """A new ``train()`` starts: no stop is pending."""
        self._stopping.clear()


def is_busy(owner: Any) -> bool:
    """Whether an abandoned call on ``owner`` (an environment instance) is still running."""
    with _lock:
        return _busy.get(id(owner), 0) > 0


def abandoned_running() -> list[tuple[str, float]]:
    """The abandoned calls still running: (what, seconds since abandoned), oldest first."""
    now = time.monotonic()
    with _lock:
        return sorted(((what, now - t) for what, t in _abandoned.values()), key=lambda x: -x[1])


def _refusal(what: str, owner: Any) -> str | None:
    """Why a call must not start (called holding the lock), or None."""
    if owner is not None and _busy.get(id(owner), 0) > 0:
        return (f"was not called: an earlier call on the same {type(owner).__name__} timed out and is still running "
                "in the background")
    if len(_abandoned) >= MAX_ABANDONED:
        return (f"was not called: {len(_abandoned)} calls that timed out are still running in the background "
                f"(at most {MAX_ABANDONED}); calls are refused until some of them end")
    return None


def call(fn: Callable, *, timeout_s: float | None, what: str, where: str = "", args: tuple = (),
         kwargs: dict[str, Any] | None = None, await_result: bool = True, owner: Any = None) -> Any:
    """``fn(*args, **kwargs)`` within ``timeout_s`` seconds (module docstring). An awaitable result is awaited in the
    same bound (``await_result``; else it is returned as it is, to be run by :func:`gather`). Exceptions of ``fn``
    are raised as they are. Raises :class:`CallTimeout` (``what`` names the function, ``where`` the rows) when the
    bound passes or the call is refused. ``owner``: the object the call works on, when calls on it must not overlap
    (an environment instance: refused while an abandoned call on it runs)."""
    kwargs = kwargs or {}
    if timeout_s is None:
        with _lock:
            busy = owner is not None and _busy.get(id(owner), 0) > 0
        if busy:
            raise CallTimeout(what, None, where, reason=_refusal(what, owner))
        result = fn(*args, **kwargs)
        return asyncio.run(_awaited(result)) if await_result and inspect.isawaitable(result) else result
    deadline = time.monotonic() + timeout_s
    box: dict[str, Any] = {}
    done = threading.Event()
    state = {"abandoned": False}
    torch = sys.modules.get("torch")  # grad mode is per thread: the call gets the caller's
    grad = torch.is_grad_enabled() if torch is not None else None

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad) if grad is not None else contextlib.nullcontext():
                result = fn(*args, **kwargs)
            if await_result and inspect.isawaitable(result):
                box["awaiting"] = True
                try:
                    result = asyncio.run(_awaited(result, max(0.0, deadline - time.monotonic())))
                except asyncio.TimeoutError:
                    if time.monotonic() < deadline:  # the coroutine's own timeout, not the bound
                        raise
                    box["timed_out"] = True
                    return
            box["value"] = result
        except BaseException as e:  # noqa: BLE001 - handed to the caller (or dropped with the abandoned call)
            box["error"] = e
        finally:
            with _lock:
                done.set()
                if state["abandoned"]:
                    _release(threading.get_ident(), owner)

    with _lock:
        refused = _refusal(what, owner)
    if refused:
        raise CallTimeout(what, timeout_s, where, reason=refused)
    thread = threading.Thread(target=run, name=f"grpokit-call: {what}"[:60], daemon=True)
    thread.start()
    if not done.wait(timeout_s) and box.get("awaiting"):
        done.wait(ASYNC_GRACE_S)  # a coroutine is being cancelled at the bound: let it finish unwinding
    with _lock:
        if not done.is_set():
            state["abandoned"] = True
            _abandoned[thread.ident] = (what, time.monotonic())
            if owner is not None:
                _busy[id(owner)] = _busy.get(id(owner), 0) + 1
    if state["abandoned"] or box.get("timed_out"):  # abandoned, or a coroutine cancelled at the bound
        raise CallTimeout(what, timeout_s, where)
    if "error" in box:
        raise box.pop("error")
    return box.get("value")


def _release(ident: int, owner: Any) -> None:
    """An abandoned call ended (called holding the lock)."""
    _abandoned.pop(ident, None)
    if owner is not None:
        n = _busy.get(id(owner), 0) - 1
        if n > 0:
            _busy[id(owner)] = n
        else:
            _busy.pop(id(owner), None)


async def _awaited(awaitable, timeout_s: float | None = None):
    if timeout_s is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


_PENDING = object()


def gather(awaitables: list, timeout_s: float | None, whats: list[str], where: str = "") -> list:
    """Run ``awaitables`` concurrently on one event loop (in a daemon thread when bounded), each within ``timeout_s``:
    per awaitable its result, the exception it raised, or a :class:`CallTimeout` (``whats`` names each)."""
    if not awaitables:
        return []
    results: list[Any] = [_PENDING] * len(awaitables)

    async def one(i: int, awaitable) -> None:
        try:
            results[i] = await _awaited(awaitable, timeout_s)
        except asyncio.TimeoutError:
            results[i] = CallTimeout(whats[i], timeout_s, where)
        except BaseException as e:  # noqa: BLE001 - returned per awaitable
            results[i] = e

    async def every() -> None:
        await asyncio.gather(*(one(i, a) for i, a in enumerate(awaitables)))

    if timeout_s is None:
        _run_loop(every)
        return results
    try:
        call(_run_loop, args=(every,), timeout_s=timeout_s + ASYNC_GRACE_S,
             what=f"the event loop of {', '.join(whats)}", where=where)
    except CallTimeout:  # a coroutine blocked the loop: whatever has not finished timed out
        pass
    return [CallTimeout(whats[i], timeout_s, where) if r is _PENDING else r for i, r in enumerate(results)]


def _run_loop(make: Callable) -> None:
    """``asyncio.run(make())``, or on a worker thread when this thread already runs a loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(make())
        return
    thread = threading.Thread(target=lambda: asyncio.run(make()), daemon=True, name="grpokit-event-loop")
    thread.start()
    thread.join()


def call_many(calls: list[Callable[[], Any]], timeout_s: float | None, whats: list[str],
              wheres: list[str] | None = None, concurrent: bool = True, owners: list | None = None) -> list:
    """Every call of ``calls``, each within ``timeout_s``: per call its result, the exception it raised, or a
    :class:`CallTimeout`. ``concurrent``: each in a thread of its own, all within ``timeout_s`` of the start; else
    one after another in their order (what a shared random generator draws stays deterministic). ``owners``: each
    call's owner (:func:`call`)."""
    wheres = wheres or [""] * len(calls)
    owners = owners or [None] * len(calls)
    out: list[Any] = [None] * len(calls)
    if timeout_s is None or len(calls) <= 1 or not concurrent:
        for i, fn in enumerate(calls):
            try:
                out[i] = call(fn, timeout_s=timeout_s, what=whats[i], where=wheres[i], owner=owners[i])
            except Exception as e:  # noqa: BLE001 - returned per call
                out[i] = e
        return out
    deadline = time.monotonic() + timeout_s
    threads = []
    for i, fn in enumerate(calls):
        def run(i=i, fn=fn) -> None:
            try:
                out[i] = call(fn, timeout_s=max(0.0, deadline - time.monotonic()), what=whats[i], where=wheres[i],
                              owner=owners[i])
            except CallTimeout as e:  # said with the bound, not the time that was left of it
                out[i] = CallTimeout(e.what, timeout_s, e.where, reason=e.reason)
            except Exception as e:  # noqa: BLE001 - returned per call
                out[i] = e

        t = threading.Thread(target=run, daemon=True, name="grpokit-call-many")
        t.start()
        threads.append(t)
    for t in threads:  # each waits at most its bound inside call()
        t.join()
    return out


@dataclass
class Incidents:
    """What went wrong in user code while one batch was produced: counters the trainer logs (``..._total``), and
    the cause of a stop the run must make (``stop_cause``)."""

    counts: dict[str, float] = field(default_factory=dict)
    stop_cause: str | None = None

    def count(self, name: str, n: float = 1.0) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + n

    def stop(self, cause: str, bounds: CallBounds | None) -> None:
        """The run must stop: the first cause is kept; ``bounds`` learns it, so no more user code is called."""
        if self.stop_cause is None:
            self.stop_cause = cause
        if bounds is not None:
            bounds.stop()

    def skipped(self, bounds: CallBounds) -> None:
        """User code was not called because the run is stopping: this batch must not be trained on either."""
        self.stop(STOPPING, bounds)

    def merge(self, other: Incidents) -> None:
        for name, n in other.counts.items():
            self.count(name, n)
        if self.stop_cause is None:
            self.stop_cause = other.stop_cause
