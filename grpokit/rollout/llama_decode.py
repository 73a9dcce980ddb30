"""One decode step of a Llama causal LM as a flat sequence of tensor operations, for the CPU decode loop.

A decode step of SmolLM2-135M at 8 rows multiplies 540 MB of weights; on a 2-core CPU transformers' module tree
around those matmuls (30 decoder layers, each norm, projection, rotary embedding and attention a module call with its
own views, casts and checks; the 4-D mask built again every step) adds more than half of the matmuls' time again
(benchmarks/RESULTS.md, 'Measurements behind design choices'). :func:`llama_step`
computes what ``LlamaForCausalLM.forward`` computes for one new token per row, with the model's own parameters,
rotary-embedding module, activation, cache and the weights :mod:`grpokit.rollout.packed` packed, and nothing else:
the same operations in the same order as transformers' eager code (RMSNorm in float32, rotary, attention by
``scaled_dot_product_attention`` over the key/value heads as transformers' SDPA path does for one query, residuals),
so its logits equal the model's up to float rounding (tests/rollout/test_llama_decode.py).

It applies (:func:`llama_stepper` returns None otherwise, and the loop calls the model) to ``LlamaForCausalLM``
itself on a CPU, its projections plain ``nn.Linear`` or PEFT LoRA layers whose adapters are merged or folded into
packed weights (as :func:`grpokit.rollout.transformers_backend.decoding_weights` leaves them while generating),
attention ``sdpa`` or ``eager``, and no forward hook, forward of its own or training mode on any module it bypasses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .packed import packed_linear, packed_weight

OWN_HOOK = "_grpokit_contiguous_head_input"
"""Marks the backend's pre-hook on the LM head (it makes the input contiguous: the step's input already is)."""


def _plain_linear(module: nn.Module) -> nn.Module | None:
    """The layer whose packed weight (or plain ``nn.Linear`` forward) ``module``'s forward is: itself (an
    ``nn.Linear``, or a PEFT LoRA layer packed with its adapter folded in), or a LoRA layer's base layer while its
    adapters are merged (or disabled and unmerged)."""
    if _plain(module) or (hasattr(module, "base_layer") and packed_weight(module) is not None):
        return module
    base = getattr(module, "base_layer", None)
    if not _plain(base) or _hooked(base) or "forward" in vars(module):
        return None
    merged, disabled = bool(getattr(module, "merged", False)), bool(getattr(module, "disable_adapters", False))
    return base if merged != disabled else None  # (a disabled merged layer would unmerge itself when called)


def _plain(layer) -> bool:
    """An ``nn.Linear`` computing ``linear(x, weight, bias)``: no forward of its own (``cast_lm_head_to_fp32``
    gives the head one) but the packed one of :mod:`grpokit.rollout.packed`."""
    return type(layer) is nn.Linear and ("forward" not in vars(layer) or packed_weight(layer) is not None)


def _hooked(module: nn.Module) -> bool:
    """Hooks, or a forward of its own, that the flat step would bypass."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or (
        not isinstance(module, nn.Linear) and "forward" in vars(module) and packed_weight(module) is None)


def _global_hooks() -> bool:
    from torch.nn.modules import module as m

    return bool(m._global_forward_hooks or m._global_forward_pre_hooks)


def llama_stepper(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """``step(input_ids (S, 1), attention_mask (S, L), position_ids (S, 1), cache) -> logits (S, V)`` for ``model``
    when :func:`llama_step` applies to it, else None. Call it where the model's packed weights (if any) are in place:
    it reads them on every step."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM or model.training or _global_hooks():
        return None
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager") or model.device.type != "cpu":
        return None
    inner = model.model
    bypassed = [inner, model, inner.norm, *inner.layers]
    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        bypassed += [attn, mlp, layer.input_layernorm, layer.post_attention_layernorm]
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        plain = [_plain_linear(p) for p in projections]
        if any(p is None for p in plain):
            return None
        bypassed += projections
        layers.append((layer, plain))
    head = _plain_linear(model.lm_head)
    head_hooks = list(model.lm_head._forward_pre_hooks.values())  # the backend's own makes its input contiguous
    if (head is None or model.lm_head._forward_hooks or any(not getattr(h, OWN_HOOK, False) for h in head_hooks)
            or any(_hooked(m) or m.training for m in bypassed)):  # (a module in training mode: its dropout)
        return None
    if any(type(m.input_layernorm).__name__ != "LlamaRMSNorm" for m, _ in layers):
        return None
    return lambda input_ids, attention_mask, position_ids, cache: llama_step(
        model, layers, head, input_ids, attention_mask, position_ids, cache)


def _linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``x`` (S, in), contiguous: the layer's packed weight where it has one (as its packed forward computes; a LoRA
    layer's holds its adapter folded in, its bias is its base layer's); for input of another dtype the layer's own
    forward (a folded LoRA layer's ``weight`` is its base layer's, without the adapter)."""
    packed = packed_weight(layer)
    if packed is None:
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    if x.dtype == packed.dtype:
        return packed_linear(x, packed, getattr(layer, "base_layer", layer).bias)
    return layer(x)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``: in float32, then the weight times the input's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@torch.no_grad()
def llama_step(model: nn.Module, layers: list, head: nn.Linear, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor, cache) -> torch.Tensor:
    """The logits (S, V) of ``model`` for one new token per row, its keys and values appended to ``cache``."""
    inner = model.model
    s = input_ids.shape[0]
    hidden = inner.embed_tokens(input_ids)  # (S, 1, D)
    cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)  # (S, 1, head_dim)
    hidden = hidden.view(s, -1)
    # (S, 1, 1, L): 0 where a row attends, -inf on its padding, built once for every layer (a bool mask is turned
    # into this inside each attention call, a small cost in every call; the same result)
    mask = None
    if not bool(attention_mask.all()):
        mask = torch.zeros(attention_mask.shape, dtype=hidden.dtype).masked_fill_(attention_mask == 0, float("-inf"))
        mask = mask[:, None, None, :]
    for layer, (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) in layers:
        attn = layer.self_attn
        d = attn.head_dim
        x = _rms_norm(hidden, layer.input_layernorm)
        q = _rotate(_linear(x, q_proj).view(s, -1, d), cos, sin)  # (S, H, d)
        k = _rotate(_linear(x, k_proj).view(s, -1, d), cos, sin)  # (S, H_kv, d)
        v = _linear(x, v_proj).view(s, -1, d)
        keys, values = cache.update(k.unsqueeze(2), v.unsqueeze(2), attn.layer_idx)  # (S, H_kv, L, d)
        groups = q.shape[1] // keys.shape[1]  # one query: heads of a key/value head as its "positions"
        out = torch.nn.functional.scaled_dot_product_attention(
            q.view(s, keys.shape[1], groups, d), keys, values, attn_mask=mask, scale=attn.scaling)
        hidden = hidden + _linear(out.reshape(s, -1), o_proj)
        x = _rms_norm(hidden, layer.post_attention_layernorm)
        hidden = hidden + _linear(layer.mlp.act_fn(_linear(x, gate_proj)) * _linear(x, up_proj), down_proj)
    return _linear(_rms_norm(hidden, inner.norm), head)
