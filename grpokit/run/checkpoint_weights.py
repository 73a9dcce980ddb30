"""Resuming models whose checkpoints transformers writes under other names than its modules' (most vision-language
models: ``model.language_model.*`` saved as ``model.*``, ``model.visual.*`` as ``visual.*``; fused MoE experts saved
one by one). ``Trainer``'s resume loads weights by name without strictness, so those would be skipped and the
resumed run would go on from the initial weights, with a warning only. Such a checkpoint is read back through the
model's own loader (``from_pretrained``, which applies its conversion mapping) instead."""

from __future__ import annotations

import json
import os

import torch


def saved_weight_names(checkpoint: str | os.PathLike) -> set[str] | None:
    """The weight names in a checkpoint's ``model.safetensors`` (or its sharded index); None without either."""
    single = os.path.join(checkpoint, "model.safetensors")
    index = single + ".index.json"
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f).get("weight_map", {}))
    if not os.path.isfile(single):
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt", device="cpu") as f:
        return set(f.keys())


def needs_renamed_load(model: torch.nn.Module, checkpoint: str | os.PathLike) -> bool:
    """Whether the checkpoint names weights the model does not have (saved under their original names)."""
    names = saved_weight_names(checkpoint)
    return names is not None and bool(names - set(model.state_dict())) and hasattr(type(model), "from_pretrained")


def load_renamed(model: torch.nn.Module, checkpoint: str | os.PathLike) -> None:
    """The checkpoint's weights into ``model``, read by the model's class (its conversion mapping applied) on the
    CPU, then copied in; every weight must be found (an error naming the first missing one otherwise)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    loaded = type(model).from_pretrained(os.fspath(checkpoint), dtype=dtype, device_map="cpu")
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    del loaded
    if missing or unexpected:
        raise ValueError(f"the weights of {checkpoint} do not fit the model: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
