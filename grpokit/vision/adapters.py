"""Which parts of a vision-language model train: adapters on its language model by default, its vision tower and
projector frozen unless asked.

A VLM's parameters fall in three parts, by where they sit: the ``language`` model (the module ``get_decoder()``
returns, and the LM head), the ``projector`` that maps image features into the language model's embeddings
(``multi_modal_projector``, Idefics3's ``connector``, Qwen-VL's ``visual.merger``, ...) and the ``vision`` tower (the
rest: ``visual``, ``vision_tower``, ``vision_model``, ...). PEFT's ``"all-linear"`` would put LoRA on the vision
tower's layers too; :func:`lora_settings` names the language model's linear layers only.
"""

from __future__ import annotations

import re

import torch

PARTS = ("language", "projector", "vision")
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "mm_projector", "projector", "merger", "deepstack_merger_list",
                   "embed_vision", "image_newline")
"""Module (or parameter) names of the glue between a vision tower and its language model, by family."""


def _base(model: torch.nn.Module) -> torch.nn.Module:
    from ..forward.prefix import inner_causal_lm

    return inner_causal_lm(model) or model


def language_prefixes(model: torch.nn.Module) -> list[str]:
    """The module paths of the language model inside ``model``: its decoder and its LM head."""
    base = _base(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    found = [name for name, module in base.named_modules() if name and (module is decoder or module is head)]
    if decoder is None or not found:
        raise ValueError(f"{type(base).__name__}: its language model could not be found (no get_decoder())")
    return found


def part_of(name: str, language: list[str]) -> str:
    """``"language"``, ``"projector"`` or ``"vision"`` for a parameter or module name of the base model."""
    if any(name == p or name.startswith(p + ".") for p in language):
        return "language"
    if any(piece in PROJECTOR_NAMES for piece in name.split(".")):
        return "projector"
    return "vision"


def parameter_parts(model: torch.nn.Module) -> dict[str, list[str]]:
    """The base model's parameter names by part (:data:`PARTS`). Tied weights appear once, under the language
    model."""
    base = _base(model)
    language = language_prefixes(model)
    parts: dict[str, list[str]] = {p: [] for p in PARTS}
    for name, _ in base.named_parameters():
        parts[part_of(name, language)].append(name)
    return parts


def language_lora_targets(model: torch.nn.Module) -> str:
    """A PEFT ``target_modules`` pattern (matched against whole module names) naming every linear layer of the
    language model's decoder, not its LM head and nothing of the vision tower or projector."""
    base = _base(model)
    decoder = base.get_decoder()
    prefix = next(name for name, module in base.named_modules() if module is decoder)
    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in decoder.named_modules()
                     if isinstance(module, torch.nn.Linear)})
    if not leaves:
        raise ValueError(f"{type(base).__name__}: its language model has no linear layer for LoRA")
    return rf"^{re.escape(prefix)}\..*\.({'|'.join(map(re.escape, leaves))})$"


def _top_modules(model: torch.nn.Module, part: str) -> list[str]:
    """The outermost modules of the base model whose parameters are all in ``part``, as PEFT ``modules_to_save``
    names (module lists stand for their elements; a bare parameter outside any such module, LLaVA-NeXT's
    ``image_newline``, cannot be named there)."""
    base = _base(model)
    language = language_prefixes(model)
    chosen = []
    for name, module in base.named_modules():
        if not name or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        params = [f"{name}.{p}" for p, _ in module.named_parameters()]
        if params and all(part_of(p, language) == part for p in params):
            chosen.append(name)
    return sorted(n for n in chosen if not any(n.startswith(other + ".") for other in chosen))


def lora_settings(model: torch.nn.Module, *, train_projector: bool = False, train_vision: bool = False) -> dict:
    """``target_modules`` and ``modules_to_save`` for ``peft.LoraConfig`` on a VLM: adapters on the language model's
    linear layers; the projector and the vision tower frozen, or trained in full (PEFT's modules to save) when
    asked."""
    save = []
    if train_projector:
        save += _top_modules(model, "projector")
    if train_vision:
        save += _top_modules(model, "vision")
    return {"target_modules": language_lora_targets(model), "modules_to_save": save or None}


def freeze_vision(model: torch.nn.Module, *, vision: bool = True, projector: bool = True) -> list[str]:
    """Stop gradients to the vision tower and/or the projector (full fine-tuning of the language model only).
    Returns the frozen parameter names."""
    parts = parameter_parts(model)
    base = _base(model)
    frozen = (parts["vision"] if vision else []) + (parts["projector"] if projector else [])
    params = dict(base.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen
