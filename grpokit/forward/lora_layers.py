"""PEFT's LoRA layers as grpokit's fast paths see them: which layers a model has, and which compute the plain
``base(x) + s·B(A(x))`` those paths reproduce (folded into packed weights while generating,
:mod:`grpokit.rollout.packed`; one autograd node in the log-prob forwards, :mod:`grpokit.forward.fused_lora`)."""

from __future__ import annotations

import torch


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's LoRA-wrapped layers of ``model`` (each with its adapters beside a ``base_layer``)."""
    return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def plain_adapter(layer: torch.nn.Module) -> str | None:
    """The name of ``layer``'s one adapter when ``layer`` is a PEFT LoRA ``Linear`` computing ``base(x) + s·B(A(x))``
    over an ``nn.Linear`` base: not merged or disabled, one active adapter, no DoRA or other variant, no biases on A
    and B, no transposed (``fan_in_fan_out``) base, no forward of its own (another context's); A and B of one
    floating dtype (float32, as PEFT keeps them by default). Else None. Dropout is not looked at (it acts in training
    mode only: the caller decides)."""
    names = list(getattr(layer, "active_adapters", None) or [])
    if (type(layer).__name__ != "Linear" or not type(layer).__module__.startswith("peft.tuners.lora")
            or len(names) != 1 or getattr(layer, "merged", True) or getattr(layer, "disable_adapters", True)
            or getattr(layer, "fan_in_fan_out", True) or "forward" in vars(layer)
            or type(getattr(layer, "base_layer", None)) is not torch.nn.Linear):
        return None
    name = names[0]
    if name not in layer.lora_A or name not in layer.lora_B or name not in getattr(layer, "scaling", {}):
        return None
    a, b = layer.lora_A[name], layer.lora_B[name]
    if not (type(a) is torch.nn.Linear and type(b) is torch.nn.Linear and a.bias is None and b.bias is None
            and a.weight.dtype == b.weight.dtype and a.weight.dtype.is_floating_point
            and not (getattr(layer, "use_dora", None) or {}).get(name)
            and not (getattr(layer, "lora_variant", None) or {}).get(name)):
        return None
    return name
