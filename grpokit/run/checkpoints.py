"""Checkpoints that survive interruptions: atomic writes, a check of what is read back, and a clean stop on
SIGINT / SIGTERM.

* **Atomic.** A checkpoint is written into ``checkpoint-N.tmp-<pid>`` beside its final place, its files are
  flushed to disk, and the directory is renamed to ``checkpoint-N`` in one step (``os.replace``). A process killed
  mid-write leaves the previous checkpoints intact and a ``.tmp-`` directory that no resume ever picks (the
  next save of a live run removes it). Only ``checkpoint-<digits>`` names count as checkpoints.
* **Checked.** :func:`verify_checkpoint` reads every file's framing before a resume: the safetensors header and
  the length it promises, the zip directory and CRC-32 checksums of ``torch.save`` files (optimizer, scheduler,
  RNG state), every JSON file. A damaged file is named in the error (:class:`CheckpointError`) instead of failing
  deep inside a loader, or loading silently. (Safetensors files carry no checksum: a flipped byte inside the
  weights of an otherwise complete file cannot be seen.)
* **Interruptible.** :class:`GracefulInterrupt` turns the first SIGINT (Ctrl-C) or SIGTERM into "finish the
  current optimizer step, save a checkpoint, stop"; a second signal stops at once (SIGINT raises
  ``KeyboardInterrupt``; SIGTERM gets its previous handler, by default the process ends).
* **Exact resume.** Checkpoints land on optimizer-step boundaries. When that boundary is inside a generation
  batch (``steps_per_generation > gradient_accumulation_steps`` or ``num_iterations > 1``) the not-yet-consumed
  rollouts are saved too (``grpokit_rollouts.safetensors``, one of the trainer's checkpoint parts:
  grpokit/run/checkpoint_parts.py), so a resumed run continues with the very same batches; transformers restores the
  sampler position and the RNG states (python, numpy, torch) that sampling uses.

Loading stays safe: weights are safetensors; the small ``torch.save`` files transformers writes (optimizer,
scheduler, RNG state) are read back by transformers 5 with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..callbacks.interrupt import GracefulInterrupt
from .file_checks import check_json as _check_json
from .file_checks import check_safetensors as _check_safetensors
from .file_checks import check_torch_save as _check_torch_save
from .file_rendezvous import FileRendezvous, remove_stale_rendezvous
from .files import fsync_tree, is_disk_full, publish_directory
from .run_dir import (
    CheckpointError,
    RunDirLock,
    check_signature,
    claim_output_dir,
    latest_checkpoint,
)

logger = logging.getLogger("grpokit")

_PARTIAL_RE = re.compile(r"^checkpoint-\d+\.(tmp|old)-(\w+)$")
_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint sentinel
_TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin")


class DiskFullError(OSError):
    """The device ran out of space while grpokit wrote; the message says what was (not) written and what is intact."""


# -- finding and checking checkpoints ----------------------------------------------------------------------------
def resolve_resume(resume: str | os.PathLike | bool | None, output_dir: str | os.PathLike) -> str | None:
    """What to resume from: ``None``/``False`` → nothing; ``"auto"`` → the latest checkpoint in ``output_dir``, or
    nothing when there is none (a first run and its restarts can share one command line); ``True`` → the latest
    checkpoint, which must exist; a path → that checkpoint. The result is checked with :func:`verify_checkpoint`."""
    if resume is None or resume is False:
        return None
    if resume is True or (isinstance(resume, str) and resume.strip().lower() == "auto"):
        found = latest_checkpoint(output_dir)
        if found is None:
            if resume is True:
                raise CheckpointError(f"no checkpoint to resume from in {str(output_dir)!r} (no checkpoint-<step> "
                                      "directory); start without resuming or pass a checkpoint path")
            return None
        path = found
    else:
        path = Path(resume)
    verify_checkpoint(path)
    return str(path)


def verify_checkpoint(path: str | os.PathLike) -> int:
    """Check that ``path`` is a complete, undamaged checkpoint and return its step.

    Raises :class:`CheckpointError` naming the file: a missing ``trainer_state.json`` or weights, an unfinished
    (``.tmp-``) directory, a truncated safetensors file, a ``torch.save`` file whose zip directory is gone, or a
    JSON file that does not parse."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist or is not a directory")
    if _PARTIAL_RE.match(p.name) or (p / _INCOMPLETE_MARKER).exists():
        raise CheckpointError(f"checkpoint {str(p)!r} is unfinished (the run was stopped while writing it); "
                              "resume from an earlier checkpoint")
    state_file = p / "trainer_state.json"
    if not state_file.is_file():
        raise CheckpointError(f"{state_file} is missing: {str(p)!r} is not a complete checkpoint")
    for f in sorted(p.rglob("*")):
        if not f.is_file():
            continue
        if f.name.endswith(".safetensors"):
            _check_safetensors(f)
        elif f.name.endswith(".json"):
            _check_json(f)
        elif f.name.endswith(_TORCH_SAVE_SUFFIXES):
            _check_torch_save(f)
    state = json.loads(state_file.read_text())
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{state_file} is damaged: it has no valid global_step ({step!r})")
    weights = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
               "pytorch_model.bin", "pytorch_model.bin.index.json", "adapter_model.bin")
    if not any((p / w).is_file() for w in weights) and not any(
            (d / "adapter_model.safetensors").is_file() for d in p.iterdir() if d.is_dir()) and not _deepspeed_weights(p):
        raise CheckpointError(f"checkpoint {str(p)!r} holds no model weights (model.safetensors, "
                              "adapter_model.safetensors or DeepSpeed's global_step*/ model states)")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        for shard in sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())):
            if not (p / shard).is_file():
                raise CheckpointError(f"{p / shard} is missing (listed in {index})")
    return step


def _deepspeed_weights(p: Path) -> bool:
    """A DeepSpeed engine checkpoint (ZeRO-3 without 16-bit gathering on save): ``latest`` names the tag
    directory that holds every rank's model states."""
    latest = p / "latest"
    if not latest.is_file():
        return False
    tag = p / latest.read_text().strip()
    if not tag.is_dir() or not any(tag.glob("*model_states.pt")):
        raise CheckpointError(f"{latest} names {tag.name!r}, which holds no model states: the DeepSpeed checkpoint "
                              "is incomplete")
    return True


# -- writing checkpoints ----------------------------------------------------------------------------------------
def rng_state() -> dict | None:
    """The random generators' states as transformers' checkpoints hold them (``rng_state*.pth``): Python's, NumPy's,
    torch's CPU and CUDA ones; None on other accelerators (their states are left to transformers' own save)."""
    import random

    import numpy as np
    import torch

    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type != "cuda":
        return None
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        state["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return state


class _NoRendezvous:
    """A single process's stalled save: nothing to meet."""

    def wait(self, name: str) -> None:
        pass


def _tmp_tag(trainer) -> str:
    # every process writes its RNG state into the same directory: under several processes the name must not
    # depend on the pid
    return str(os.getpid()) if trainer.args.world_size <= 1 else "shared"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_partial_checkpoints(run_dir: str | os.PathLike) -> list[str]:
    """Delete ``checkpoint-N.tmp-*`` / ``.old-*`` directories left by killed runs (not those of a live process
    other than this one). Returns the removed paths."""
    root = Path(run_dir)
    removed = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        m = _PARTIAL_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        tag = m.group(2)
        if tag.isdigit() and int(tag) != os.getpid() and _pid_alive(int(tag)):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(str(p))
    return removed


# -- the rollouts of a generation batch that straddles a checkpoint ----------------------------------------------
# -- loading ----------------------------------------------------------------------------------------------------
@contextmanager
def _loading(what: str, checkpoint, files: str = "") -> Iterator[None]:
    """Any failure while transformers loads part of a checkpoint becomes one CheckpointError naming the part."""
    try:
        yield
    except Exception as e:
        where = f"{checkpoint} ({files})" if files else f"{checkpoint}"
        raise CheckpointError(f"{what} in {where} could not be loaded: {type(e).__name__}: {e}") from e


class CheckpointingMixin:
    """What :class:`grpokit.GRPOTrainer` adds to ``transformers.Trainer`` around checkpoints: atomic saves, a checked
    and ``"auto"``-resolving ``resume_from_checkpoint``, restored rollouts, and the signal handling above."""

    interrupted: int | None = None
    interrupt_checkpoint: str | None = None
    _resume_checkpoint: str | None = None
    _stalled_save: FileRendezvous | _NoRendezvous | None = None
    rollout_rng_state: dict | None = None
    """The RNG states as the latest rollout of the training thread started (:func:`rng_state`): what a checkpoint
    written while that rollout is stuck records."""

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, *,
              force_resume: bool = False, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint`` also takes ``"auto"`` (the latest checkpoint in
        ``output_dir``, or a fresh start when there is none), and is checked before anything is loaded: a damaged
        checkpoint, or one written with other settings (model, batch shape, generations, loss; ``force_resume``
        accepts it), is refused. The output directory is locked while training runs, and a fresh run into a
        directory holding an earlier run's checkpoints is refused unless ``overwrite_output_dir``
        (grpokit/run/run_dir.py)."""
        args = self.args
        lock = RunDirLock(args.output_dir).acquire() if args.should_save else None
        try:
            resume = resolve_resume(resume_from_checkpoint, args.output_dir)
            claim_output_dir(args.output_dir, resuming=resume is not None, overwrite=args.overwrite_output_dir,
                             remove=args.should_save)
            if args.should_save:
                remove_stale_rendezvous(args.output_dir)
            if resume is not None:
                check_signature(self.run_signature(), resume, force_resume)
            return self._train_guarded(resume, trial, ignore_keys_for_eval, **kwargs)
        finally:
            if lock is not None:
                lock.release()

    def _train_guarded(self, resume: str | None, trial, ignore_keys_for_eval, **kwargs):
        self._resume_checkpoint = resume
        self.interrupted = None
        self.interrupt_checkpoint = None
        guard = next((c for c in self.callback_handler.callbacks if isinstance(c, GracefulInterrupt)), None)
        if guard is None:
            guard = GracefulInterrupt(self)
            self.add_callback(guard)
        guard.install()
        completed = False
        try:
            result = super().train(resume_from_checkpoint=resume, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            completed = True
            return result
        finally:
            guard.uninstall()
            self.interrupted = guard.received
            # a rollout producer stops however training ended; a completed run gets its averaged weights
            self.end_training(completed=completed and not self.interrupted)

    def _save_checkpoint(self, model, trial) -> None:
        """One narrow override: transformers' own ``_save_checkpoint`` writes the checkpoint, with ``output_dir``
        pointed at a staging directory ``checkpoint-N.tmp-<tag>`` while it runs and rotation deferred; then the
        trainer's unconsumed rollouts are added, every file is flushed to disk, the checkpoint is renamed into place in
        one step and older checkpoints are rotated (``save_total_limit``)."""
        args = self.args
        if trial is not None:  # hyper-parameter search names its own run directories: no staging
            return super()._save_checkpoint(model, trial)
        run_dir, limit = args.output_dir, args.save_total_limit
        name = f"checkpoint-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        staging = f"{final}.tmp-{_tmp_tag(self)}"
        if args.should_save:
            os.makedirs(run_dir, exist_ok=True)
            remove_partial_checkpoints(run_dir)
            shutil.rmtree(staging, ignore_errors=True)
        self._everyone("staged")
        args.output_dir, args.save_total_limit = staging, None
        written = os.path.join(staging, name)
        try:
            try:
                super()._save_checkpoint(model, trial)
            finally:
                args.output_dir, args.save_total_limit = run_dir, limit
            if not args.save_only_model:
                self._save_trainer_state(written)
            best = self.state.best_model_checkpoint
            if best and best.startswith(staging):  # transformers recorded the staging path: record the final one
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
                if args.should_save:
                    self.state.save_to_json(os.path.join(written, "trainer_state.json"))
            self._everyone("written")
            if args.should_save:
                fsync_tree(written)
                publish_directory(written, final)
        except Exception as e:  # a full disk, a quota: nothing half-written stays, earlier checkpoints are untouched
            full = is_disk_full(e, run_dir)  # safetensors says so in its text only, torch.save not at all
            shutil.rmtree(staging, ignore_errors=True)
            if full:
                previous = latest_checkpoint(run_dir)
                raise DiskFullError(
                    f"no space left on the device of {run_dir!r} while saving {name}: it was not written (nothing "
                    f"half-written is left); {f'{previous.name} is intact' if previous else 'no earlier checkpoint'}. "
                    "Free some space, then resume") from e
            raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self._everyone("published")

    def _everyone(self, name: str) -> None:
        """A checkpoint writer's barrier: the process group's, or, in a stalled run's save, the file rendezvous."""
        if self._stalled_save is not None:
            self._stalled_save.wait(name)
        else:
            self.accelerator.wait_for_everyone()

    def save_stalled_checkpoint(self, rendezvous: FileRendezvous | None = None) -> str:
        """Save a checkpoint from the watchdog's thread while the training thread is stuck in a rollout (its weights
        and optimizer are those of the last optimizer step): atomically, as a periodic save, with the RNG state the
        rollout started from (the one a periodic checkpoint of the last step holds), and, under several processes,
        without a collective: ``rendezvous`` stands in for the process group's barriers, and the flops are counted
        on this process alone. A resume from it trains as an uninterrupted run would. Returns its path."""
        self._stalled_save = rendezvous if rendezvous is not None else _NoRendezvous()
        try:
            self._save_checkpoint(self.model, None)
        finally:
            self._stalled_save = None
        return f"{self.args.output_dir}/checkpoint-{self.state.global_step}"

    def store_flos(self) -> None:
        if self._stalled_save is None:
            return super().store_flos()
        self.state.total_flos += self.current_flos  # this process's: a sum over processes is a collective
        self.current_flos = 0

    def _save_rng_state(self, output_dir: str) -> None:
        snapshot = self.rollout_rng_state if self._stalled_save is not None else None
        if snapshot is None:
            return super()._save_rng_state(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        name = "rng_state.pth" if self.args.world_size <= 1 else f"rng_state_{self.args.process_index}.pth"
        import torch

        torch.save(snapshot, os.path.join(output_dir, name))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from .checkpoint_weights import load_renamed, needs_renamed_load

        with _loading("the model weights", resume_from_checkpoint):
            target = model if model is not None else self.model
            if not self.is_deepspeed_enabled and not self.is_fsdp_enabled and needs_renamed_load(target,
                                                                                                resume_from_checkpoint):
                return load_renamed(target, resume_from_checkpoint)  # a VLM's checkpoint names (checkpoint_weights.py)
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        with _loading("the optimizer or scheduler state", checkpoint, "optimizer.pt, scheduler.pt"):
            return super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint):
        with _loading("the RNG state", checkpoint, "rng_state.pth"):
            return super()._load_rng_state(checkpoint)
