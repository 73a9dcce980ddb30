"""Linear layers with their weights pre-packed for oneDNN while generating on a CPU.

A decode step multiplies a few rows by every weight matrix of the model. torch's default CPU path (MKL's GEMM)
repacks each weight on every call; oneDNN's inner-product primitive with a weight packed once into its blocked layout
reads it as it is. On a 2-core AMD EPYC (AVX2 only) a whole decode step of SmolLM2-135M in float32 took 63 instead of
82 ms at 8 rows and 114 instead of 134 ms at 32 (``benchmarks/bench_packed.py``, benchmarks/RESULTS.md). Packing
every weight takes ~0.2 s and one more copy of the linear weights in memory for as long as the context lasts; the
results equal the unpacked layers' up to float rounding (another summation order). Only float32 weights on a CPU
with oneDNN; anything else is left as is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_PACKED = "_grpokit_packed_weight"
"""Set on a layer while it computes with a packed weight: that weight (so nested contexts pack once)."""


def packed_weight(layer: torch.nn.Module) -> torch.Tensor | None:
    """The packed weight ``layer`` computes with inside :func:`packed_linears`, else None."""
    return getattr(layer, _PACKED, None)


def packed_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows`` (N, in), contiguous float32, times a weight packed by :func:`packed_linears`, plus ``bias``."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packable(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and isinstance(w, torch.Tensor) and w.dtype == torch.float32
            and w.device.type == "cpu" and not hasattr(module, _PACKED)
            and "forward" not in vars(module))  # a forward of its own (cast_lm_head_to_fp32's) is left alone


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows_hint: int = 32) -> Iterator[int]:
    """Within the block every float32 ``nn.Linear`` of ``model`` on a CPU computes with a packed copy of its weight
    (no gradient: for generation only); yields how many layers it packed. The weights must not change inside the
    block (they are packed once, on entry)."""
    layers = [m for m in model.modules() if _packable(m)] if packing_available() else []
    for layer in layers:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), rows_hint)

        def forward(x: torch.Tensor, layer=layer, packed=packed) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            if flat.dtype != torch.float32 or torch.is_grad_enabled():
                return torch.nn.functional.linear(x, layer.weight, layer.bias)
            out = packed_linear(flat.contiguous(), packed, layer.bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])

        layer.forward = forward
        setattr(layer, _PACKED, packed)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward
            delattr(layer, _PACKED)
