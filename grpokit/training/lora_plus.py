"""LoRA+ (Hayou, Ghosh & Yu, arXiv 2402.12354): the adapter's ``B`` matrices learn ``loraplus_lr_ratio`` times faster
than its ``A`` matrices.

A LoRA update is ``ΔW = (α/r)·B·A`` with ``B`` started at zero. With one learning rate ``η`` for both, the paper
shows that for wide layers ``B`` learns too slowly for the features to move efficiently, and that ``η_B = λ·η_A``
with ``λ`` around 16 fixes it (up to ~2× faster fine-tuning in their runs). Here the optimizer built by the
trainer keeps its groups and settings; each group's ``lora_B`` / ``lora_embedding_B`` parameters move into a group
of their own, identical but for ``lr × λ`` (the learning-rate schedule then scales both alike)."""

from __future__ import annotations

import torch

B_MARKERS = ("lora_B", "lora_embedding_B")


def is_lora_b(name: str) -> bool:
    return any(f".{marker}." in f".{name}." for marker in B_MARKERS)


def split_lora_b_groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module, ratio: float) -> int:
    """Move the ``B`` matrices of every param group of ``optimizer`` (made before any step) into a copy of that group
    with ``lr × ratio``. Returns how many parameters moved; raises when the model has no trainable ``B`` matrix."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    moved = 0
    new_groups = []
    for group in optimizer.param_groups:
        b = [p for p in group["params"] if is_lora_b(names.get(id(p), ""))]
        if not b:
            continue
        b_ids = {id(p) for p in b}
        group["params"] = [p for p in group["params"] if id(p) not in b_ids]
        new_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": b, "lr": group["lr"] * ratio})
        moved += len(b)
    if not moved:
        raise ValueError(f"loraplus_lr_ratio={ratio!r} needs LoRA adapters: the model has no trainable lora_B matrix "
                         "(use peft_config / a LoRA model, or leave loraplus_lr_ratio at None)")
    for group in new_groups:
        optimizer.add_param_group(group)
    return moved
