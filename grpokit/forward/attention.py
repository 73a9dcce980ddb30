"""Which attention kernel the trainer's log-prob forwards use: transformers' eager attention instead of SDPA where the
CPU's SDPA is measured slower — bf16 on a CPU, short sequences.

On a CPU, torch's SDPA runs a flash-attention kernel; in bf16 its backward is several times slower than the eager
computation (``softmax(q·kᵀ·scale + mask) · v``, the softmax in float32: transformers' ``eager_attention_forward``)
at the sizes of GRPO on a CPU. On a 2-core Xeon with AMX, forward and backward of one layer's attention, bf16, 9 query
heads over 3 key/value heads of 64 (SmolLM2-135M): 17 rows × 7 queries × 60 keys 9.3 ms with SDPA against 3.5 ms
eager; 32 × 25 × 52 17.2 against 3.9 ms; 8 × 200 × 200 23.5 against 14.5 ms; but 8 × 256 × 512 41 against 73 ms and
4 × 1024 × 1024 115 against 375 ms (the eager attention weights, rows × heads × queries × keys in float32, no longer
fit the caches). In float32 SDPA was as fast or faster at every one of these sizes. The step benchmark's LoRA step on
bf16 weights spent 0.52 s in the backward eager against 0.74 s with SDPA (benchmarks/RESULTS.md, 'Eager attention for
short bf16 forwards').

:func:`eager_attention_where_faster` switches a model's SDPA configs to ``"eager"`` for a block, where the model's
embedding weights are bf16 on a CPU and the block's attention weights stay under
:data:`EAGER_MAX_ATTENTION_BYTES`; the backward of what ran inside follows the kernels the forward used. Generation is
not affected (its decode step calls SDPA itself: one query a row, forward only, where SDPA is the faster)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .prefix import inner_causal_lm, recomputes_activations

EAGER_MAX_ATTENTION_BYTES = 16 * 2**20
"""Eager attention only where one layer's attention weights (rows × heads × positions², float32) take at most this
many bytes: 12 MB was 1.6× faster eager, 38 MB 1.8× slower (the sizes above)."""


def _configs(config) -> list:
    """``config`` and its sub-configs, recursively (a vision-language model's text and vision configs)."""
    out = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            out += _configs(sub)
    return out


def _eager_pays(model: torch.nn.Module, rows: int, positions: int) -> bool:
    config = getattr(model, "config", None)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if config is None or not isinstance(weight, torch.Tensor):
        return False
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    return isinstance(heads, int) and rows * heads * positions * positions * 4 <= EAGER_MAX_ATTENTION_BYTES


@contextlib.contextmanager
def eager_attention_where_faster(model: torch.nn.Module, rows: int, positions: int,
                                 holds_backward: bool = False) -> Iterator[bool]:
    """Within the block ``model`` (a transformers model) computes attention eagerly instead of with SDPA when its
    embedding weights are bf16 on a CPU and ``rows`` sequences of ``positions`` tokens keep one layer's attention
    weights within :data:`EAGER_MAX_ATTENTION_BYTES`; yields whether it switched. Only the configs that say
    ``"sdpa"`` are switched, and each is set back to it on leaving the block (nested blocks: the outer one's choice
    holds). Under gradient checkpointing the backward computes the forward again, so a forward with gradients is
    switched only by a block that also holds its backward (``holds_backward``: the trainer's training step):
    the recomputation then takes the same kernel."""
    model = inner_causal_lm(model)
    recomputed = torch.is_grad_enabled() and recomputes_activations(model)
    pays = model is not None and (holds_backward or not recomputed) and _eager_pays(model, rows, positions)
    switched = [c for c in _configs(model.config) if
                getattr(c, "_attn_implementation_internal", None) == "sdpa"] if pays else []
    for config in switched:
        config._attn_implementation_internal = "eager"
    try:
        yield bool(switched)
    finally:
        for config in switched:
            config._attn_implementation_internal = "sdpa"
