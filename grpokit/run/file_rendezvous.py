"""Processes that meet through files, when no collective can be used: the ranks of a stalled run (one rank stuck in
user code, the others waiting for it inside a collective) agree on, and write, one checkpoint from their watchdog
threads (grpokit/callbacks/stall.py). A collective from such a thread would interleave with the one the training
thread is blocked in; files in the run's directory (which every rank writes its checkpoint into anyway) do not.

Each meeting point has a name; a rank arrives by writing ``<name>-<rank>`` (with a value: a vote) atomically into the
meeting's directory, then waits until every rank's file is there, within a bound: past it, :class:`RendezvousTimeout`
names the ranks that did not come.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .files import atomic_write_text

STALL_DIR_PREFIX = ".stall-rendezvous-"
"""The meeting directories a stalled run's ranks use in ``output_dir`` (``.stall-rendezvous-<step>``)."""


class RendezvousTimeout(TimeoutError):
    """Some ranks did not arrive within the bound."""

    def __init__(self, name: str, missing: list[int], timeout_s: float):
        self.missing = missing
        ranks = ", ".join(map(str, missing))
        super().__init__(f"rank{'s' if len(missing) > 1 else ''} {ranks} did not reach {name!r} within {timeout_s:g} s")


class FileRendezvous:
    """``world_size`` processes meeting in ``directory`` (the same path on every rank, on a file system they share)."""

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, timeout_s: float,
                 poll_s: float = 0.05):
        self.directory, self.rank, self.world_size = Path(directory), rank, world_size
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.directory.mkdir(parents=True, exist_ok=True)

    def wait(self, name: str, value: str = "", timeout_s: float | None = None) -> dict[int, str]:
        """Arrive at ``name`` with ``value``; once every rank has arrived, every rank's value by rank."""
        atomic_write_text(self.directory / f"{name}-{self.rank}", value)
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        while True:
            missing = [r for r in range(self.world_size) if not (self.directory / f"{name}-{r}").is_file()]
            if not missing:
                return {r: (self.directory / f"{name}-{r}").read_text() for r in range(self.world_size)}
            if time.monotonic() >= deadline:
                raise RendezvousTimeout(name, missing, bound)
            time.sleep(self.poll_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """The last meeting: every rank says it is done; the main rank waits for them (briefly) and removes the
        directory, so no rank still reads it when it goes. One that does not come leaves it for the next run's start
        to remove (:func:`remove_stale_rendezvous`)."""
        if self.rank != 0:
            atomic_write_text(self.directory / f"closed-{self.rank}", "")
            return
        try:
            self.wait("closed", timeout_s=timeout_s)
        except RendezvousTimeout:
            return
        shutil.rmtree(self.directory, ignore_errors=True)


def remove_stale_rendezvous(run_dir: str | os.PathLike) -> None:
    """Meeting directories an earlier, killed run left in ``run_dir`` (called by the main process as training starts,
    before any rank can meet)."""
    root = Path(run_dir)
    if root.is_dir():
        for p in root.glob(STALL_DIR_PREFIX + "*"):
            shutil.rmtree(p, ignore_errors=True)
