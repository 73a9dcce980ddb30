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
  rollouts are saved too (``grpokit_rollouts.safetensors``), so a resumed run continues with the very same
  batches; transformers restores the sampler position and the RNG states (python, numpy, torch) that sampling uses.

Loading stays safe: weights are safetensors; the small ``torch.save`` files transformers writes (optimizer,
scheduler, RNG state) are read back by transformers 5 with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import struct
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import TrainerCallback

logger = logging.getLogger("grpokit")

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_PARTIAL_RE = re.compile(r"^checkpoint-\d+\.(tmp|old)-(\w+)$")
ROLLOUTS_FILE = "grpokit_rollouts.safetensors"
_INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint sentinel
_TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and what is wrong with it."""


# -- finding and checking checkpoints ----------------------------------------------------------------------------
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


def _damaged(f: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{f} is damaged: {what}; resume from an earlier checkpoint or delete this one")


def _check_safetensors(f: Path) -> None:
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _damaged(f, f"the file has {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise _damaged(f, f"the header claims {n} bytes but the file has {size} (truncated)")
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise _damaged(f, f"the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _damaged(f, "the safetensors header is not a JSON object")
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end != size:
        raise _damaged(f, f"the header promises {8 + n + end} bytes but the file has {size}"
                          + (" (truncated)" if size < 8 + n + end else ""))


def _check_json(f: Path) -> None:
    try:
        json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise _damaged(f, f"not valid JSON ({e})") from None


def _check_torch_save(f: Path) -> None:
    """A ``torch.save`` file is a zip archive: its directory must be there and every entry must match its CRC-32
    (``torch.load`` itself does not check them, so a flipped byte would load silently)."""
    try:
        with zipfile.ZipFile(f) as z:
            size = f.stat().st_size
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    raise _damaged(f, f"entry {info.filename!r} runs past the end of the file (truncated)")
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise _damaged(f, f"not a readable torch.save archive ({e}; truncated?)") from None
    if bad is not None:
        raise _damaged(f, f"entry {bad!r} does not match its CRC-32 checksum")


# -- writing checkpoints ----------------------------------------------------------------------------------------
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


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _publish(tmp: str, final: str) -> None:
    """Rename ``tmp`` to ``final`` in one step; an existing ``final`` (the same step saved again) is moved aside
    first and deleted after."""
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    parent = os.path.dirname(final) or "."
    try:
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint_atomically(trainer, model, trial=None) -> str:
    """``Trainer._save_checkpoint`` of transformers 5.24, writing into ``checkpoint-N.tmp-<pid>`` and renaming it to
    ``checkpoint-N`` once every file is on disk. Rotation (``save_total_limit``) runs after the rename."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

    args, state = trainer.args, trainer.state
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = trainer._get_output_dir(trial=trial)
    final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    tmp = f"{final}.tmp-{_tmp_tag(trainer)}"
    if args.should_save:
        os.makedirs(run_dir, exist_ok=True)
        remove_partial_checkpoints(run_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()

    trainer.save_model(tmp, _internal_call=True)
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        trainer.accelerator.wait_for_everyone()
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best):
            state.best_model_checkpoint = best
    if not args.save_only_model:
        trainer._save_optimizer_and_scheduler(tmp)
        trainer._save_scaler(tmp)
        trainer._save_rng_state(tmp)
        save_rollout_buffer(trainer, tmp)
    if args.should_save:
        for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks.get(name), list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
    trainer.accelerator.wait_for_everyone()
    if args.should_save:
        _fsync_tree(tmp)
        _publish(tmp, final)
    trainer.accelerator.wait_for_everyone()
    if args.push_to_hub:
        trainer._push_from_checkpoint(final)
    if args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
    return final


# -- the rollouts of a generation batch that straddles a checkpoint ----------------------------------------------
def _rollouts_name(trainer) -> str:
    if trainer.args.world_size <= 1:
        return ROLLOUTS_FILE
    return ROLLOUTS_FILE.replace(".safetensors", f"_{trainer.args.process_index}.safetensors")


def save_rollout_buffer(trainer, output_dir: str) -> None:
    """Save the micro-batches not consumed yet when the checkpoint falls inside a generation batch."""
    buffer = getattr(trainer, "_buffer", None)
    every = getattr(trainer, "_generate_every", 1)
    if not buffer or getattr(trainer, "_micro_step", 0) % every == 0:
        return
    from safetensors.torch import save_file

    tensors = {}
    for i, part in enumerate(buffer):
        for key, value in part.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{i}/{key}"] = value.detach().to("cpu").clone()  # parts may share a tensor
    os.makedirs(output_dir, exist_ok=True)
    save_file(tensors, os.path.join(output_dir, _rollouts_name(trainer)),
              metadata={"parts": str(len(buffer)), "micro_step": str(trainer._micro_step)})


def load_rollout_buffer(trainer, checkpoint: str) -> bool:
    """Restore the saved micro-batches of a checkpoint taken inside a generation batch; False when the checkpoint
    is on a generation boundary (nothing to restore) or has no saved rollouts (the batch is regenerated)."""
    every = getattr(trainer, "_generate_every", 1)
    if trainer._micro_step % every == 0:
        return False
    path = os.path.join(checkpoint, _rollouts_name(trainer))
    if not os.path.isfile(path):
        logger.warning("checkpoint %s falls inside a generation batch and holds no saved rollouts: that batch is "
                       "generated again, so the resumed run is not step-for-step identical", checkpoint)
        return False
    from safetensors import safe_open

    device = trainer.accelerator.device
    with safe_open(path, framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        parts: list[dict[str, Any]] = [{} for _ in range(int(meta.get("parts", "0")))]
        for name in f.keys():
            i, key = name.split("/", 1)
            parts[int(i)][key] = f.get_tensor(name).to(device)
    optional = ("old_logps", "ref_logps", "sampler_logps", "sampler_ratio")
    for part in parts:
        for key in optional:
            part.setdefault(key, None)
    trainer._buffer = parts
    return True


# -- signals ----------------------------------------------------------------------------------------------------
@contextmanager
def _loading(what: str, checkpoint, files: str = "") -> Iterator[None]:
    """Any failure while transformers loads part of a checkpoint becomes one CheckpointError naming the part."""
    try:
        yield
    except Exception as e:
        where = f"{checkpoint} ({files})" if files else f"{checkpoint}"
        raise CheckpointError(f"{what} in {where} could not be loaded: {type(e).__name__}: {e}") from e


class GracefulInterrupt(TrainerCallback):
    """First SIGINT/SIGTERM: finish the optimizer step in progress, save a checkpoint, stop training (``train()``
    returns normally; ``trainer.interrupted`` holds the signal number, ``trainer.interrupt_checkpoint`` the path).
    Second signal: stop at once. Handlers are installed only while ``train()`` runs, from the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, trainer):
        self.trainer = trainer
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    # installed around Trainer.train by GRPOTrainer.train
    def install(self) -> None:
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            if sig == signal.SIGTERM and getattr(self.trainer.args, "enable_jit_checkpoint", False):
                continue  # transformers' own SIGTERM checkpointing was asked for
            if signal.getsignal(sig) == signal.SIG_IGN:
                continue  # ignored by whoever started us (e.g. nohup): keep it so
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, TypeError):
                pass
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # second signal: stop now
            self.uninstall()
            signal.raise_signal(signum)
            if signum == signal.SIGINT:  # a SIGINT handler that does not raise: make sure we stop
                raise KeyboardInterrupt
            return
        self.received = signum
        name = signal.Signals(signum).name
        logger.warning("grpokit: %s received: finishing the current step, saving a checkpoint and stopping "
                       "(send it again to stop at once)", name)

    def on_step_end(self, args, state, control, **kw):
        stop = self.received is not None
        if args.world_size > 1:  # every process must stop at the same step, whichever received the signal
            flag = torch.tensor([1.0 if stop else 0.0], device=self.trainer.accelerator.device)
            stop = bool(self.trainer.accelerator.reduce(flag, reduction="max").item())
            if stop and self.received is None:
                self.received = signal.SIGTERM
        if stop:
            control.should_save = True
            control.should_log = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kw):
        if self.received is not None:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            self.trainer.interrupt_checkpoint = os.path.join(self.trainer._get_output_dir(None),
                                                             f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        return control


class CheckpointingMixin:
    """What :class:`grpokit.GRPOTrainer` adds to ``transformers.Trainer`` around checkpoints: atomic saves, a checked
    and ``"auto"``-resolving ``resume_from_checkpoint``, restored rollouts, and the signal handling above."""

    interrupted: int | None = None
    interrupt_checkpoint: str | None = None
    _resume_checkpoint: str | None = None

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint`` also takes ``"auto"`` (the latest checkpoint in
        ``output_dir``, or a fresh start when there is none), and is checked before anything is loaded."""
        resume = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        self._resume_checkpoint = resume
        self.interrupted = None
        self.interrupt_checkpoint = None
        guard = next((c for c in self.callback_handler.callbacks if isinstance(c, GracefulInterrupt)), None)
        if guard is None:
            guard = GracefulInterrupt(self)
            self.add_callback(guard)
        guard.install()
        try:
            return super().train(resume_from_checkpoint=resume, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            guard.uninstall()
            self.interrupted = guard.received

    def _save_checkpoint(self, model, trial) -> None:
        save_checkpoint_atomically(self, model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        with _loading("the model weights", resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        with _loading("the optimizer or scheduler state", checkpoint, "optimizer.pt, scheduler.pt"):
            return super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint):
        with _loading("the RNG state", checkpoint, "rng_state.pth"):
            return super()._load_rng_state(checkpoint)
