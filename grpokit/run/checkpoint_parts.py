"""The state a grpokit checkpoint holds beyond transformers' own files, as a list of *stateful parts*.

A part is any object with a ``checkpoint_file`` name, ``state_dict()`` and ``load_state_dict(state)``; the trainer
lists its parts (``GRPOTrainer.checkpoint_parts``), and adding one is one line there. The name says the format and the
owner:

- ``*.json``: the state is JSON values; ``*.safetensors``: tensors, and any other values JSON-encoded into the file's
  metadata;
- a name with ``{process}`` (the process index) or ``{suffix}`` (``_<index>`` under several processes, empty on one) is
  per process: every process writes and reads its own; any other name is written by the main process only and read
  by every process.

``state_dict()`` may return None: nothing to save now (a file already in the checkpoint directory is left alone).
On resume, a part whose file the checkpoint does not hold is left as it is, and told so when it has a
``missing_from_checkpoint(path)`` method. Files are written atomically (the checkpoint writer also stages the whole
directory).
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

import torch

from .files import atomic_write_bytes, atomic_write_text


class StatefulPart(Protocol):
    checkpoint_file: str

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def part_path(part: StatefulPart, directory: str | os.PathLike, process_index: int, world_size: int) -> str:
    name = part.checkpoint_file.format(process=process_index, suffix=f"_{process_index}" if world_size > 1 else "")
    return os.path.join(directory, name)


def per_process(part: StatefulPart) -> bool:
    return "{process}" in part.checkpoint_file or "{suffix}" in part.checkpoint_file


def save_parts(parts: list[StatefulPart], directory: str | os.PathLike, process_index: int = 0, world_size: int = 1,
               is_main_process: bool = True) -> None:
    """Each part's state into ``directory``: per-process parts by every process, the others by the main one."""
    for part in parts:
        if not (per_process(part) or is_main_process):
            continue
        state = part.state_dict()
        if state is None:
            continue
        path = part_path(part, directory, process_index, world_size)
        if path.endswith(".json"):
            atomic_write_text(path, json.dumps(state))
            continue
        from safetensors.torch import save

        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items() if isinstance(v, torch.Tensor)}
        metadata = {k: json.dumps(v) for k, v in state.items() if not isinstance(v, torch.Tensor)}
        atomic_write_bytes(path, save(tensors, metadata=metadata))


def load_parts(parts: list[StatefulPart], checkpoint: str | os.PathLike, process_index: int = 0,
               world_size: int = 1) -> None:
    """Each part's state from ``checkpoint`` (tensors on the CPU: a part moves them where it keeps them). A file that
    does not fit its part is a ValueError naming the file."""
    for part in parts:
        path = part_path(part, checkpoint, process_index, world_size)
        if not os.path.isfile(path):
            missing = getattr(part, "missing_from_checkpoint", None)
            if missing is not None:
                missing(path)
            continue
        state = _read(path)
        try:
            part.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} does not fit this run: {e}") from e


def _read(path: str) -> dict[str, Any]:
    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        state: dict[str, Any] = {name: f.get_tensor(name) for name in f.keys()}
        for key, value in (f.metadata() or {}).items():
            try:
                state[key] = json.loads(value)
            except json.JSONDecodeError:
                state[key] = value
    return state
