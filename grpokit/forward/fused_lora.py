"""LoRA layers as one autograd operation in the log-prob forwards.

PEFT computes a LoRA layer as four autograd operations, ``base(x)``, ``A(x)``, ``B(·)``, ``· s`` and a sum, each of
the last two a pass over the layer's whole output and a node of its own in the backward. :class:`LoRALinear` computes
the same ``y = x·Wᵀ + bias + s·(x·Aᵀ)·Bᵀ`` (Hu et al. 2021, "LoRA", eq. 3 with ``s = α/r``) as one node: the adapter's
term added by the GEMM that computes it (``addmm`` with ``alpha = s``), and a backward written out for the three
tensors that need gradients (``x``, ``A``, ``B``; ``W`` is frozen), the scaling folded into the small products. The
same computation up to float rounding (the sum's order); what the fast paths of Unsloth's LoRA kernels also do. On
SmolLM2-135M with r 16 on every linear layer, float32 on a 2-core Xeon, the loss's forward took about a third less
time, its backward a little less, and the peak memory went down (benchmarks/RESULTS.md, 'Measurements behind design
choices').

:func:`fused_lora` puts it in place of PEFT's forward for the block's duration, on the layers where it computes what
PEFT would (:func:`grpokit.forward.lora_layers.plain_adapter`, and at call time: input and base weight of one dtype or
autocast, no dropout that acts, no arguments beyond the input); any other call goes to PEFT's forward."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

from .lora_layers import lora_layers, plain_adapter


class LoRALinear(torch.autograd.Function):
    """``y = x·Wᵀ + bias + s·(x·Aᵀ)·Bᵀ`` for ``x`` (N, in), ``W`` (out, in), ``A`` (r, in), ``B`` (out, r); ``W`` and
    ``bias`` get no gradient. Backward, with ``g = ∂L/∂y`` and ``gB = g·B`` (N, r):
    ``∂L/∂x = g·W + s·gB·A``, ``∂L/∂A = s·gBᵀ·x``, ``∂L/∂B = s·gᵀ·(x·Aᵀ)``.

    Adapters of another dtype than ``x`` and ``W`` (PEFT keeps them in float32 over a bf16 base) are computed as PEFT
    does: ``x`` cast to theirs, the sum in theirs, ``y`` cast back to ``x``'s; in the backward ``g`` cast to theirs
    and the adapter's share of ``∂L/∂x`` cast to ``x``'s before it is added."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scale: float):
        x_a = x if x.dtype == a.dtype else x.to(a.dtype)
        xa = torch.mm(x_a, a.t())
        y = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
        if y.dtype == a.dtype:
            y.addmm_(xa, b.t(), alpha=scale)
        else:
            y = torch.addmm(y.to(a.dtype), xa, b.t(), alpha=scale).to(x.dtype)
        ctx.save_for_backward(x, weight, a, b, xa)
        ctx.scale = scale
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, weight, a, b, xa = ctx.saved_tensors
        s = ctx.scale
        g = g.contiguous()
        g_a = g if g.dtype == a.dtype else g.to(a.dtype)
        g_b = torch.mm(g_a, b)  # (N, r)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g, weight)
            if grad_x.dtype == a.dtype:
                grad_x.addmm_(g_b, a, alpha=s)
            else:
                grad_x += torch.mm(g_b, a).mul_(s).to(grad_x.dtype)
        grad_a = grad_b = None
        if ctx.needs_input_grad[3]:
            grad_a = torch.mm(g_b.t(), x if x.dtype == a.dtype else x.to(a.dtype)).mul_(s)
        if ctx.needs_input_grad[4]:
            grad_b = torch.mm(g_a.t(), xa).mul_(s)
        return grad_x, None, None, grad_a, grad_b, None


def _forward(layer: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A plain LoRA layer's forward with :class:`LoRALinear` where the call allows it, else PEFT's (bound to the layer
    as a method, so a copy of the layer made inside the block computes with its own weights). Under autocast every
    operand is cast to autocast's dtype first, as autocast casts PEFT's three linear layers (the casts are autograd's:
    the float32 adapters get float32 gradients)."""
    names = list(layer.active_adapters)
    name = names[0] if len(names) == 1 else None
    if name is None or args or kwargs or layer.merged or layer.disable_adapters or name not in layer.lora_A:
        return type(layer).forward(layer, x, *args, **kwargs)
    base, dropout = layer.base_layer, layer.lora_dropout[name]
    w, bias, a, b = base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight
    autocast = torch.is_autocast_enabled(x.device.type)
    if ((x.dtype != w.dtype and not autocast) or a.dtype != b.dtype or w.requires_grad
            or (x.dtype != a.dtype and not getattr(layer, "cast_input_dtype_enabled", True))
            or (bias is not None and bias.requires_grad) or not x.is_floating_point()
            or not (type(dropout) is torch.nn.Identity
                    or (type(dropout) is torch.nn.Dropout and (dropout.p == 0 or not dropout.training)))):
        return type(layer).forward(layer, x, *args, **kwargs)
    rows, scale = x.reshape(-1, x.shape[-1]), float(layer.scaling[name])
    if autocast:
        dtype = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            y = LoRALinear.apply(rows.to(dtype), w.to(dtype), None if bias is None else bias.to(dtype), a.to(dtype),
                                 b.to(dtype), scale)
    else:
        y = LoRALinear.apply(rows, w, bias, a, b, scale)
    return y.view(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def fused_lora(model: torch.nn.Module) -> Iterator[int]:
    """Within the block ``model``'s plain LoRA layers compute with :class:`LoRALinear` (where a call allows it, see
    the module); yields how many layers it took. Not for weights sharded by FSDP or ZeRO-3 (nothing is changed
    there: the wrappers gather a layer's weights around its forward)."""
    from .sharding import sharding_kind

    layers = [m for m in lora_layers(model) if plain_adapter(m) is not None] if sharding_kind(model) is None else []
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            if "forward" in vars(layer):
                del layer.forward
