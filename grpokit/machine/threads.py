"""Torch's CPU thread count fitted to the cores that are actually free.

torch starts one thread per core. When other CPU-bound processes already run on a small machine, those threads
oversubscribe the cores and spin against each other: on a 2-core machine with one other busy process, a demo
step took many times longer with torch's default 2 threads than with 1 (benchmarks/RESULTS.md, 'Measurements
behind design choices'). A job on the CPU therefore uses
``cores - busy`` threads (at least 1), where ``busy`` is how many cores other processes kept busy over half a
second when it starts (``/proc/stat``; the 1-minute load average where that is missing, which lags: it still
counts a process that just ended), unless the user chose a count (``OMP_NUM_THREADS`` or
``GRPOKIT_NUM_THREADS``).

While a job trains, the count follows the free cores (:class:`FreeCoresFollower`, after every optimizer step): what
other processes kept busy since it last looked, from ``/proc/stat`` less the CPU time of this process, its threads
and its descendants (a job's own rollout workers are not "other processes"). So a busy half second at the start no
longer slows a whole run: on a 2-core Xeon a demo started while another job was finishing ran all of its training on
one thread, 78 steps where a quiet start fits 130 (benchmarks/RESULTS.md, 'Measurements behind design choices'). On
a quiet machine nothing changes, so runs of a seed still repeat there."""

from __future__ import annotations

import os
import time

USER_SETTINGS = ("GRPOKIT_NUM_THREADS", "OMP_NUM_THREADS")


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat, or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])


def _proc_stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, CPU ticks: user + system, its own and its waited-for children's) of process ``pid``, or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and ")"
        return int(fields[1]), sum(int(x) for x in fields[11:15])
    except (OSError, ValueError, IndexError):
        return None


def own_cpu_ticks(pid: int | None = None) -> int | None:
    """CPU time, in ``/proc/stat``'s ticks, of process ``pid`` (default this one) and its live descendants, each with
    the children it has waited for; None without ``/proc``."""
    root = os.getpid() if pid is None else pid
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    stats = {int(p): st for p in pids if (st := _proc_stat(p)) is not None}
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for p, (parent, _) in stats.items():
        children.setdefault(parent, []).append(p)
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += stats[p][1]
        todo.extend(children.get(p, ()))
    return total


def threads_for(cores: int, busy: float) -> int:
    """Torch threads for ``cores`` usable cores of which other processes keep ``busy`` busy: the free ones, at least
    one (a core 70% busy elsewhere counts as taken)."""
    return max(1, min(cores, cores - int(busy + 0.3)))


def user_chose_threads() -> bool:
    return any(name in os.environ for name in USER_SETTINGS)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class FreeCoresFollower:
    """Torch's thread count kept at the free cores while a job trains (:meth:`follow`, after each optimizer step).

    Each look measures what other processes kept busy since the last one, at least ``min_window_s`` apart: all CPUs'
    busy ticks (``/proc/stat``) less this process tree's (:func:`own_cpu_ticks`). The count changes when two looks
    in a row ask for the same new one (a burst inside one window does not flip it), never above ``ceiling`` (torch's
    count before the job fitted it) nor below one. Only :meth:`follow` sets torch's threads."""

    def __init__(self, ceiling: int, min_window_s: float = 3.0):
        self.ceiling = ceiling
        self.min_window_s = min_window_s
        self.pending: int | None = None
        self.last = self._look()

    @staticmethod
    def _look() -> tuple[float, tuple[int, int], int] | None:
        times, own = _cpu_times(), own_cpu_ticks()
        return None if times is None or own is None else (time.monotonic(), times, own)

    def busy_elsewhere(self) -> float | None:
        """Cores other processes kept busy since the last look (None: too soon to tell, or no ``/proc``)."""
        if self.last is None or time.monotonic() - self.last[0] < self.min_window_s:
            return None
        now = self._look()
        if now is None:
            return None
        (_, (idle0, total0), own0), (_, (idle1, total1), own1) = self.last, now
        self.last = now
        elapsed = total1 - total0
        if elapsed <= 0:
            return None
        others = (elapsed - (idle1 - idle0)) - (own1 - own0)
        cpus = os.cpu_count() or 1
        return max(0.0, others / elapsed * cpus - (cpus - _usable_cores()))

    def follow(self) -> str | None:
        """Look, and set torch's threads to the free cores when two looks in a row ask for the same new count;
        returns a line saying so (None: nothing changed)."""
        import torch

        busy = self.busy_elsewhere()
        if busy is None:
            return None
        cores = _usable_cores()
        want, now = min(self.ceiling, threads_for(cores, busy)), torch.get_num_threads()
        if want == now or want != self.pending:
            self.pending = None if want == now else want
            return None
        self.pending = None
        torch.set_num_threads(want)
        return (f"other processes now keep {busy:.1f} of {cores} cores busy: using {want} torch thread"
                f"{'s' if want > 1 else ''} instead of {now}")


def free_cores(window_s: float = 0.5) -> tuple[int, float]:
    """(cores this process may run on, how many of them other processes keep busy). This process sleeps through
    the measurement, so what is busy is someone else's work."""
    cores = _usable_cores()
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
    want = threads_for(cores, load)
    if want >= torch.get_num_threads():
        return None
    torch.set_num_threads(want)
    return (f"other processes keep {load:.1f} of {cores} cores busy: using {want} torch thread"
            f"{'s' if want > 1 else ''} instead of {cores} (set GRPOKIT_NUM_THREADS to choose)")
