"""The reward process's own side (``python -m grpokit.rewards.process_child``; the trainer's side is
:mod:`grpokit.rewards.process`).

It reads frames from standard input and answers on what was standard output: a frame is 8 bytes of length, then a
``dill`` pickle. Standard output itself is pointed at standard error first, so a reward function that prints cannot
corrupt the answers. Before unpickling the reward functions it limits its own memory (``RLIMIT_DATA``: the heap and
every private anonymous mapping, which is where Python's objects, NumPy's and torch's CPU tensors live) and asks the
kernel to end it when the trainer's process ends (``PR_SET_PDEATHSIG``), so not even a ``SIGKILL`` of the trainer
leaves it behind.

Frames in: ``("init", functions, sys_path, limit_bytes)`` once, then ``("call", index, kwargs)``. Frames out:
``("ready", pid)``; per call ``("ok", values, metrics, extras)`` (what the function returned, and what it logged
through ``log_metric`` / ``log_extra``), ``("error", message)`` (it raised: the message names the function and the
row, as in the trainer's process), or ``("memory", message)``, after which the process ends: one that ran out of
memory is not trusted with the next call.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import struct
import sys
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")


def read_frame(stream: BinaryIO) -> Any:
    """One frame from ``stream``; None at its end."""
    import dill

    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return dill.loads(payload)


def write_frame(stream: BinaryIO, message: Any) -> None:
    import dill

    payload = dill.dumps(message)
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def _end_with_the_parent() -> None:
    """The kernel sends this process SIGKILL when the process that started it ends (Linux); elsewhere, nothing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent was already gone before the request took effect
        os._exit(1)


def _limit_memory(limit_bytes: int | None) -> None:
    if limit_bytes is None:
        return
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))


def _call(func, kwargs: dict[str, Any]) -> tuple:
    metrics: list[tuple[str, float]] = []
    extras: list[tuple[str, list]] = []
    kwargs = dict(kwargs, log_metric=lambda name, value: metrics.append((str(name), float(value))),
                  log_extra=lambda column, values: extras.append((str(column), list(values))))
    try:
        value = func(**kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return ("ok", value, metrics, extras)
    except MemoryError as e:
        return ("memory", f"MemoryError: {e}" if str(e) else "MemoryError")
    except Exception as e:  # noqa: BLE001 - the trainer's process raises it, with the row named
        from .registry import reward_func_name
        from .scoring import _reward_error

        name = reward_func_name(func)
        n = len(kwargs.get("completions") or [])
        try:
            return ("error", str(_reward_error(name, func, kwargs, n, e)))
        except MemoryError:
            return ("memory", "MemoryError (while locating the row that raised)")


async def _awaited(awaitable):
    return await awaitable


def main() -> None:
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a reward function's print goes to standard error, never into the answers
    sys.stdout = sys.stderr
    for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C or a scheduler's SIGTERM is the trainer's to handle: it
        signal.signal(sig, signal.SIG_IGN)        # saves at a step boundary and then ends this process
    _end_with_the_parent()
    requests = sys.stdin.buffer
    first = read_frame(requests)
    if first is None or first[0] != "init":
        return
    _, functions, sys_path, limit_bytes = first
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    _limit_memory(limit_bytes)
    try:
        import dill

        funcs = dill.loads(functions)
    except MemoryError:
        write_frame(answers, ("memory", "MemoryError while loading the reward functions"))
        return
    except Exception as e:  # noqa: BLE001 - the trainer says it in one line
        write_frame(answers, ("error", f"the reward functions could not be loaded in the reward process: "
                                       f"{type(e).__name__}: {e}"))
        return
    write_frame(answers, ("ready", os.getpid()))
    while True:
        try:
            request = read_frame(requests)
            if request is None:
                return
            _, index, kwargs = request
            answer = _call(funcs[index], kwargs)
        except MemoryError:
            answer = ("memory", "MemoryError (while reading the batch)")
        write_frame(answers, answer)
        if answer[0] == "memory":
            return


if __name__ == "__main__":
    main()
