"""Torch's CPU thread count fitted to the cores that are actually free.

torch starts one thread per core. When other CPU-bound processes already run on a small machine, those threads
oversubscribe the cores and spin against each other: on a 2-core machine with one other busy process, a demo
step took 193 s with torch's default 2 threads and 17 s with 1. A job on the CPU therefore uses
``cores - busy`` threads (at least 1), where ``busy`` is the 1-minute load average when it starts, unless the
user chose a count (``OMP_NUM_THREADS`` or ``GRPOKIT_NUM_THREADS``)."""

from __future__ import annotations

import os

USER_SETTINGS = ("GRPOKIT_NUM_THREADS", "OMP_NUM_THREADS")


def free_cores() -> tuple[int, float]:
    """(cores this process may run on, the 1-minute load average)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return cores, load


def fit_torch_threads() -> str | None:
    """Set torch's intra-op threads to the free cores; returns a line saying what changed (None: nothing did)."""
    import torch

    chosen = os.environ.get("GRPOKIT_NUM_THREADS")
    if chosen is not None:
        try:
            n = int(chosen)
        except ValueError:
            raise ValueError(f"GRPOKIT_NUM_THREADS={chosen!r} is not allowed: expected a positive integer") from None
        if n < 1:
            raise ValueError(f"GRPOKIT_NUM_THREADS={chosen!r} is not allowed: expected a positive integer")
        torch.set_num_threads(n)
        return None
    if "OMP_NUM_THREADS" in os.environ:
        return None
    cores, load = free_cores()
    busy = int(load + 0.5)
    want = max(1, min(cores, cores - busy))
    if want >= torch.get_num_threads():
        return None
    torch.set_num_threads(want)
    return (f"the CPU is busy (load {load:.1f} on {cores} cores): using {want} torch thread"
            f"{'s' if want > 1 else ''} instead of {cores} (set GRPOKIT_NUM_THREADS to choose)")
