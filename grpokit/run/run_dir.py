"""Output directories are owned by one run at a time and never silently reused.

- **A lock while a run writes.** ``<output_dir>/.grpokit.lock`` is held with ``flock`` (released by the kernel when
  the process ends, however it ends) and names its holder; a second run into the same directory gets one line
  naming it (:class:`RunDirBusy`).
- **Earlier runs are kept.** A fresh run into a directory that holds an earlier run's checkpoints (and, for a
  ``grpokit train`` job, its final model, report or metrics) is refused (:class:`RunDirOccupied`) unless it resumes
  or the user asked to overwrite (``overwrite_output_dir`` / ``--overwrite``); then the earlier run's files are
  removed first, so the two runs never mix.
- **A resume means the same run.** Every checkpoint records what it means (:func:`run_signature`: model, batch
  shape, generations, loss); resuming with any of these changed is refused with the differences listed
  (:class:`ResumeMismatch`) unless forced.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from ..validation import refusal
from .files import atomic_write_text

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
LOCK_FILE = ".grpokit.lock"
SIGNATURE_FILE = "grpokit_run.json"
JOB_OUTPUTS = ("final", "report.json", "report.md", "metrics.jsonl", "eval_before.json")
"""What a ``grpokit train`` job leaves besides checkpoints."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and what is wrong with it."""


class RunDirError(ValueError):
    """The output directory cannot be used as asked; the message says why and what to do."""


class RunDirBusy(RunDirError):
    pass


class RunDirOccupied(RunDirError):
    pass


class ResumeMismatch(CheckpointError):
    """A resume whose settings changed what the checkpoint means; :meth:`describe` words it for the caller's way of
    forcing it (a Python argument, a command-line flag)."""

    def __init__(self, checkpoint: str | os.PathLike, changes: list[str], how_to_force: str):
        self.checkpoint, self.changes = str(checkpoint), changes
        super().__init__(self.describe(how_to_force))

    def describe(self, how_to_force: str) -> str:
        return (f"checkpoint {self.checkpoint!r} was written with other settings ({'; '.join(self.changes)}); "
                f"resuming would continue a different run. Restore those settings, or force it ({how_to_force})")


def check_output_dir(output_dir: Any, create: bool = True) -> Path:
    """``output_dir`` as a usable directory path: not empty, not a file, creatable and writable (one line each).
    ``create``: make it; otherwise only check that it could be made (its nearest existing parent is writable)."""
    if not isinstance(output_dir, (str, os.PathLike)) or not str(output_dir).strip():
        raise refusal("output_dir", output_dir, "expected a directory path", error=RunDirError)
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise RunDirError(f"output_dir={str(output_dir)!r} is a file, not a directory: choose a directory path")
    if not create:
        existing = next(p for p in [path, *path.absolute().parents] if p.exists())
        if not existing.is_dir():
            raise RunDirError(f"output_dir={str(output_dir)!r} cannot be created: {str(existing)!r} is a file")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise RunDirError(f"output_dir={str(output_dir)!r} is not writable by this user ({str(existing)!r}): "
                              "choose another directory")
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"output_dir={str(output_dir)!r} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunDirError(f"output_dir={str(output_dir)!r} is not writable by this user: choose another directory")
    return path


class RunDirLock:
    """Hold ``<output_dir>/.grpokit.lock`` for the life of a run (non-blocking: a held lock is an error naming the
    holder). Re-entrant within one process (a job's trainer takes it again)."""

    _held: dict[str, RunDirLock] = {}

    def __init__(self, output_dir: str | os.PathLike):
        self.dir = check_output_dir(output_dir)
        self.path = self.dir / LOCK_FILE
        self.fh = None
        self.depth = 0

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> RunDirLock:
        key = str(self.path.resolve())
        held = RunDirLock._held.get(key)
        if held is not None:
            held.depth += 1
            return held
        import fcntl

        fh = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise RunDirBusy(f"output_dir {str(self.dir)!r} is in use by another run ({holder[:200]}); wait for it to "
                             "finish or choose another output_dir") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        fh.flush()
        self.fh, self.depth = fh, 1
        RunDirLock._held[key] = self
        return self

    def release(self) -> None:
        self.depth -= 1
        if self.depth > 0 or self.fh is None:
            return
        RunDirLock._held.pop(str(self.path.resolve()), None)
        try:
            self.fh.seek(0)
            self.fh.truncate()
        except OSError:
            pass
        self.fh.close()  # closing releases the flock
        self.fh = None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories (``checkpoint-<step>``) in ``output_dir``, oldest step first. Unfinished
    ``checkpoint-N.tmp-*`` directories are never listed."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step in ``output_dir``, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def earlier_run(output_dir: str | os.PathLike, job_outputs: bool = False) -> list[str]:
    """What an earlier run left in ``output_dir``: its checkpoints (also unfinished ones), and with ``job_outputs``
    the job's final model, report and metrics."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p.name for p in list_checkpoints(root)]
    if job_outputs:
        found += [name for name in JOB_OUTPUTS if (root / name).exists()]
    return found


def claim_output_dir(output_dir: str | os.PathLike, *, resuming: bool, overwrite: bool, job_outputs: bool = False,
                     remove: bool = True, how_to_resume: str = "resume_from_checkpoint='auto'",
                     how_to_overwrite: str = "overwrite_output_dir=True") -> None:
    """A fresh run (not ``resuming``) may start in ``output_dir`` only when no earlier run left anything there, or
    with ``overwrite``: the earlier run's files are then removed first (by the process that writes: ``remove``)."""
    if resuming:
        return
    found = earlier_run(output_dir, job_outputs)
    if not found:
        return
    if not overwrite:
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        raise RunDirOccupied(f"output_dir {str(output_dir)!r} holds an earlier run ({shown}); a fresh run would "
                             f"replace it. Continue that run ({how_to_resume}), choose another output_dir, or "
                             f"replace it ({how_to_overwrite})")
    if not remove:
        return
    root = Path(output_dir)
    for name in found:
        target = root / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    for p in root.iterdir():  # unfinished checkpoints of the earlier run
        if p.is_dir() and p.name.startswith("checkpoint-") and not CHECKPOINT_RE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


# -- what a checkpoint means ----------------------------------------------------------------------------------------
SIGNATURE_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "num_generations",
                    "generation_batch_size", "steps_per_generation", "num_iterations", "loss_type",
                    "importance_sampling_level", "ema_decay")


def run_signature(args, model_name: str | None, adapter: bool) -> dict[str, Any]:
    """The settings a checkpoint's state depends on: a resume with any of them changed is a different run."""
    sig = {name: getattr(args, name, None) for name in SIGNATURE_FIELDS}
    sig.update(model=model_name, adapter=bool(adapter))
    return sig


def save_signature(signature: dict[str, Any], checkpoint_dir: str | os.PathLike) -> None:
    atomic_write_text(Path(checkpoint_dir) / SIGNATURE_FILE, json.dumps(signature, indent=1, sort_keys=True))


def check_signature(signature: dict[str, Any], checkpoint: str | os.PathLike, force: bool = False,
                    how_to_force: str = "train(..., force_resume=True)") -> None:
    """Refuse to resume ``checkpoint`` with settings that changed since it was written (listed); ``force`` lets it
    through. A checkpoint without a signature (written before grpokit kept one) is accepted."""
    path = Path(checkpoint) / SIGNATURE_FILE
    if force or not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{path} is damaged (not JSON): resume from an earlier checkpoint") from None
    changed = [f"{k}: {saved.get(k)!r} → {signature.get(k)!r}" for k in sorted(set(saved) | set(signature))
               if saved.get(k) != signature.get(k)]
    if changed:
        raise ResumeMismatch(checkpoint, changed, how_to_force)
