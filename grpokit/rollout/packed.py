"""Linear layers with their weights pre-packed for oneDNN while generating on a CPU.

A decode step multiplies a few rows by every weight matrix of the model. torch's default CPU path (MKL's GEMM in
float32, oneDNN's matmul in bf16) repacks each weight on every call; oneDNN's inner-product primitive with a weight
packed once into its blocked layout reads it as it is. On a 2-core AMD EPYC (AVX2 only) a whole decode step of
SmolLM2-135M in float32 is faster packed, more so at 8 rows than at 32 (``benchmarks/bench_packed.py``); in bf16 on
a 2-core Xeon with AMX a whole step (through transformers' forward) is faster too, its matmuls alone about twice as
fast (benchmarks/RESULTS.md, 'Measurements behind design choices').
Packing every weight takes a fraction of a second and one more copy of the linear weights in memory for as long as
the context lasts;
the results equal the unpacked layers' up to float rounding (another summation order). float32 weights on a CPU with
oneDNN, and bf16 ones where oneDNN computes bf16 (:func:`packable_dtypes`: AVX512-BF16, AMX, AVX-NE-CONVERT);
anything else is left as is.

A PEFT LoRA layer is packed with its adapter folded in, ``W + s·B·A`` (summed in float32, rounded once to the base
weight's dtype), without writing that into ``W`` (what merging and unmerging the adapter around generation did: on
SmolLM2-135M with r 16 on every linear layer, merge, pack and unmerge took more than twice as long a generation batch
in float32 as folding while packing, benchmarks/RESULTS.md, 'Measurements behind design choices'; a bf16 base was
merged into and restored from a copy) — where every LoRA layer of the
model can be (:func:`foldable_lora`); otherwise the adapters are merged first
(:func:`grpokit.rollout.transformers_backend.lora_merged`) and the merged weights packed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..forward.lora_layers import lora_layers, plain_adapter
from .precision import GenerationCopy

_PACKED = "_grpokit_packed_weight"
"""Set on a layer while it computes with a packed weight: that weight (so nested contexts pack once)."""


def packed_weight(layer: torch.nn.Module):
    """What ``layer`` computes with inside :func:`packed_linears`: its packed weight (a tensor), or with a
    ``precision`` its :class:`grpokit.rollout.precision.GenerationCopy`; else None. Either has the ``dtype`` of the
    input it takes."""
    return getattr(layer, _PACKED, None)


def packed_linear(rows: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows`` (N, in), contiguous and of ``packed.dtype``, times a weight packed by :func:`packed_linears` (or its
    copy in another precision), plus ``bias``."""
    if isinstance(packed, GenerationCopy):
        return packed(rows, bias)
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes packed: float32, and bf16 where oneDNN computes bf16 on this CPU (its check honours
    ``ONEDNN_MAX_CPU_ISA``; without it oneDNN refuses to pack bf16)."""
    if not packing_available():
        return ()
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def _foldable(layer: torch.nn.Module, precision: str | None = None) -> bool:
    """A plain LoRA layer (:func:`grpokit.forward.lora_layers.plain_adapter`) over a packable base layer (with a
    ``precision``: over a base layer that can be copied, :func:`_copyable`)."""
    base = layer.base_layer if hasattr(layer, "base_layer") else None
    return plain_adapter(layer) is not None and (_copyable(base) if precision else _packable(base))


def foldable_lora(model: torch.nn.Module, precision: str | None = None) -> list[torch.nn.Module]:
    """Every LoRA layer of ``model`` when each can be packed (or copied into ``precision``) with its adapter folded
    in (:func:`_foldable`), else none (the adapters are then merged before packing, all of them or none)."""
    layers = lora_layers(model) if precision or packing_available() else []
    return layers if layers and all(_foldable(m, precision) for m in layers) else []


@torch.no_grad()
def folded_weight(layer: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A foldable LoRA layer's ``W + s·B·A`` in a new tensor, summed in float32 and rounded once to ``dtype``
    (default ``W``'s: a bf16 merge rounds twice, ``s·B·A`` to bf16, then the sum); ``W`` itself is not written."""
    (name,) = layer.active_adapters
    w = layer.base_layer.weight
    return torch.addmm(w.float(), layer.lora_B[name].weight.float(), layer.lora_A[name].weight.float(),
                       alpha=layer.scaling[name]).to(dtype or w.dtype)


def lora_folded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s LoRA layers compute with their adapters folded into packed weights (an enclosing
    :func:`packed_linears` block folded them)."""
    return any(packed_weight(m) is not None for m in lora_layers(model))


def _packable(module: torch.nn.Module, dtypes: tuple[torch.dtype, ...] | None = None) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and isinstance(w, torch.Tensor)
            and w.dtype in (packable_dtypes() if dtypes is None else dtypes)
            and w.device.type == "cpu" and not hasattr(module, _PACKED)
            and "forward" not in vars(module))  # a forward of its own (cast_lm_head_to_fp32's) is left alone


def _copyable(module: torch.nn.Module | None) -> bool:
    """An ``nn.Linear`` on a CPU with a floating weight, not packed yet and without a forward of its own: what a
    ``precision`` copies (:class:`grpokit.rollout.precision.GenerationCopy`)."""
    w = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and isinstance(w, torch.Tensor) and w.is_floating_point()
            and w.device.type == "cpu" and not hasattr(module, _PACKED) and "forward" not in vars(module))


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows_hint: int = 32, precision: str | None = None) -> Iterator[int]:
    """Within the block every float32 (or bf16: :func:`packable_dtypes`) ``nn.Linear`` of ``model`` on a CPU
    computes with a packed copy of its weight
    (no gradient: for generation only), and every LoRA layer with its adapter folded into one where all of them can be
    (:func:`foldable_lora`); yields how many layers it packed. The weights must not change inside the block (they are
    packed once, on entry). With a ``precision`` (``"float32"``, ``"bf16"``, ``"int8"``: ``rollout_precision``),
    every ``nn.Linear`` on a CPU computes with a copy of its weight in that precision instead
    (:class:`grpokit.rollout.precision.GenerationCopy`), the adapters folded in the same way."""
    folded = foldable_lora(model, precision)
    folded_ids = {id(m) for m in folded}  # LoRA layers folded here or by an enclosing block: their base layers and
    covered = {id(x) for m in lora_layers(model) if id(m) in folded_ids or packed_weight(m) is not None  # adapters
               for x in (m.base_layer, *m.lora_A.values(), *m.lora_B.values())}  # are not called: not packed
    dtypes = packable_dtypes()
    if precision:
        layers = [m for m in model.modules() if _copyable(m) and id(m) not in covered]
        for layer in folded:
            _pack(layer, GenerationCopy(folded_weight(layer, torch.float32), precision, rows_hint,
                                        dtype=layer.base_layer.weight.dtype, packable=dtypes), layer.base_layer.bias)
        for layer in layers:
            _pack(layer, GenerationCopy(layer.weight, precision, rows_hint, packable=dtypes), layer.bias)
    else:
        layers = [m for m in model.modules() if _packable(m, dtypes) and id(m) not in covered]
        for layer in folded:
            _pack(layer, torch.ops.mkldnn._reorder_linear_weight(folded_weight(layer), rows_hint),
                  layer.base_layer.bias)
        for layer in layers:
            _pack(layer, torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), rows_hint), layer.bias)
    try:
        yield len(layers) + len(folded)
    finally:
        for layer in [*folded, *layers]:
            del layer.forward
            delattr(layer, _PACKED)


def _pack(layer: torch.nn.Module, packed, bias: torch.Tensor | None) -> None:
    """``layer`` computes with ``packed`` (and ``bias``) without gradients on input of the packed weight's dtype, and
    with its own forward otherwise (a LoRA layer's also in training mode: its dropout)."""
    lora = hasattr(layer, "lora_A")

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or x.dtype != packed.dtype or torch.is_grad_enabled() or (lora and layer.training):
            return type(layer).forward(layer, x, *args, **kwargs)
        flat = x.reshape(-1, x.shape[-1])
        out = packed_linear(flat.contiguous(), packed, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    layer.forward = forward
    setattr(layer, _PACKED, packed)
