"""Torch's CPU thread count fitted to the cores that are actually free.

torch starts one thread per core. When other CPU-bound processes already run on a small machine, those threads
oversubscribe the cores and spin against each other: on a 2-core machine with one other busy process, a demo
step took many times longer with torch's default 2 threads than with 1 (benchmarks/RESULTS.md, 'Measurements
behind design choices'). A job on the CPU therefore uses
``cores - busy`` threads (at least 1), where ``busy`` is how many cores other processes kept busy over half a
second when it starts (``/proc/stat``; the 1-minute load average where that is missing, which lags: it still
counts a process that just ended), unless the user chose a count (``OMP_NUM_THREADS`` or
``GRPOKIT_NUM_THREADS``)."""

from __future__ import annotations

import os

USER_SETTINGS = ("GRPOKIT_NUM_THREADS", "OMP_NUM_THREADS")


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat, or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])


def free_cores(window_s: float = 0.5) -> tuple[int, float]:
    """(cores this process may run on, how many of them other processes keep busy). This process sleeps through
    the measurement, so what is busy is someone else's work."""
    import time

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    first = _cpu_times()
    if first is not None:
        time.sleep(window_s)
        second = _cpu_times()
        if second is not None and second[1] > first[1]:
            busy_share = 1.0 - (second[0] - first[0]) / (second[1] - first[1])
            total = os.cpu_count() or cores
            return cores, max(0.0, busy_share * total - (total - cores))
    try:
        return cores, os.getloadavg()[0]
    except (AttributeError, OSError):
        return cores, 0.0


def fit_torch_threads() -> str | None:
    """Set torch's intra-op threads to the free cores; returns a line saying what changed (None: nothing did)."""
    import torch

    chosen = os.environ.get("GRPOKIT_NUM_THREADS")
    if chosen is not None:
        from ..validation import refusal

        try:
            n = int(chosen)
        except ValueError:
            raise refusal("GRPOKIT_NUM_THREADS", chosen, "expected a positive integer") from None
        if n < 1:
            raise refusal("GRPOKIT_NUM_THREADS", chosen, "expected a positive integer")
        torch.set_num_threads(n)
        return None
    if "OMP_NUM_THREADS" in os.environ:
        return None
    cores, load = free_cores()
    busy = int(load + 0.3)  # a core 70% busy elsewhere is taken
    want = max(1, min(cores, cores - busy))
    if want >= torch.get_num_threads():
        return None
    torch.set_num_threads(want)
    return (f"other processes keep {load:.1f} of {cores} cores busy: using {want} torch thread"
            f"{'s' if want > 1 else ''} instead of {cores} (set GRPOKIT_NUM_THREADS to choose)")
