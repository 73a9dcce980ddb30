"""Processes that must agree (:func:`any_process`: a flag or-ed over every process, for stopping or running one more
round at the same step everywhere), and ending a multi-process run (torchrun, accelerate launch) without the gloo
teardown race.

A gloo work thread can hold the last reference to a finished asynchronous collective (DeepSpeed ZeRO-3 issues its
all-gathers asynchronously) and release it while the interpreter shuts down: its destructor then waits for the
GIL of a finalizing interpreter, the thread is unwound through a ``noexcept`` frame and the process aborts
(``terminate called without an active exception``, SIGABRT) after all its work was done, so the launcher reports a
failed run. ``destroy_process_group`` does not prevent it (DeepSpeed and accelerate keep references to the groups,
which are only freed during finalization). So a process that ran a process group ends the way a forked worker
does: exit handlers run (logging is flushed, trackers close), standard streams are flushed, then ``os._exit``
skips the interpreter's teardown.
"""

from __future__ import annotations

import atexit
import os
import sys


def distributed_initialized() -> bool:
    """Whether this process has joined a ``torch.distributed`` process group (False when torch is not loaded)."""
    if "torch" not in sys.modules:
        return False
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def any_process(flag: bool, device=None) -> bool:
    """``flag`` or-ed over every process of the default process group (a MAX all-reduce of one number on ``device``,
    the collective backend's device), so every process takes the same branch; just ``flag`` in a single process."""
    if not distributed_initialized():
        return flag
    import torch

    if torch.distributed.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def stop_together(cause: str | None, device=None) -> None:
    """After a batch was scored: when any process carries a stop (``cause``, from
    :class:`grpokit.bounds.user_calls.Incidents`), every process raises :class:`grpokit.bounds.user_calls.RunStopped` naming the
    first rank that stopped and why, so all stop at the same point instead of some waiting for the others in their
    next collective. One MAX all-reduce of one number per batch; the causes are gathered only when there is a stop."""
    from .user_calls import RunStopped

    if not any_process(cause is not None, device):
        return
    if not distributed_initialized():
        raise RunStopped(f"the run stopped: {cause}")
    import torch

    causes: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(causes, cause)
    rank = next(i for i, c in enumerate(causes) if c is not None)
    raise RunStopped(f"rank {rank} stopped the run: {causes[rank]}")


def exit_process(code: int) -> None:
    """Exit with ``code``: with an initialized process group, exit handlers run, standard streams are flushed and
    the interpreter's teardown is skipped; otherwise a plain ``sys.exit``."""
    if not distributed_initialized():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to flush to
            pass
    os._exit(code)
