"""Encoding each prompt once for its group: the ``G`` completions of a prompt share it, so generation and the
training forward can encode it once and repeat its KV cache ``G`` times instead of encoding it ``G`` times. For
generation, also the tokens every prompt of a batch begins with (a chat template's system turn) once for the batch
(:func:`encode_common_prefix_once`).

Used by the transformers rollout backend (prefill before sampling) and by :mod:`grpokit.forward.logprobs` (the training
forward). Also home of :func:`position_ids_from_mask`, the positions both must agree on.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them, so a training forward sees the same
    positions the sampler saw."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_position_ids(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         vision_kwargs: dict | None = None) -> torch.Tensor:
    """The positions ``generate`` gives left-padded rows, for a forward that must see the same: from the mask
    (:func:`position_ids_from_mask`) without image tensors; with them (``vision_kwargs``: a vision-language model's
    image tensors) the model's own rule, its ``_prepare_position_ids_for_generation`` (Qwen-VL's M-RoPE: text and
    3-D image positions, shape (4, B, T)). The batch is always the second-to-last dimension."""
    base = inner_causal_lm(model) or model
    prepare = getattr(base, "_prepare_position_ids_for_generation", None)
    if not vision_kwargs or prepare is None:
        return position_ids_from_mask(attention_mask)
    return prepare(input_ids, {"input_ids": input_ids, "attention_mask": attention_mask, **vision_kwargs})


def inner_causal_lm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The causal LM inside DDP / PEFT wrappers, for looking up its head and config; None for a prompt-learning
    PEFT model."""
    inner = getattr(model, "module", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and inner is not None:
        model = inner
    if getattr(model, "peft_config", None) is not None and hasattr(model, "get_base_model"):
        active = getattr(model, "active_peft_config", None)
        if active is None or getattr(active, "is_prompt_learning", False):
            return None
        model = model.get_base_model()
    return model


def group_size(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, also_same: torch.Tensor | None = None) -> int:
    """``G`` when the rows are whole groups of ``G`` identical consecutive prompts (how the trainer sends them),
    else 1. ``also_same``: (n - 1,) whether row ``i + 1`` also equals row ``i`` in what the ids do not show (a
    VLM's images: the same question about another picture is another prompt)."""
    n = prompt_ids.shape[0]
    if n < 2:
        return 1
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)
    if also_same is not None:
        same = same & also_same.to(same.device)
    breaks = (~same).nonzero().flatten().tolist()
    g = breaks[0] + 1 if breaks else n
    if g < 2 or n % g:
        return 1
    expected = [i * g - 1 for i in range(1, n // g)]
    return g if breaks == expected else 1


@functools.cache
def cache_argument() -> str:
    """The name transformers' causal LMs take their KV cache by: ``cache`` since transformers 5.20,
    ``past_key_values`` before (5.19 is the newest that vLLM's CPU build accepts). A cache passed by the other name
    would be swallowed by the forward's ``**kwargs`` and silently unused."""
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def with_cache(cache, **kwargs) -> dict:
    """``kwargs`` plus ``cache`` under the name this transformers takes it by (:func:`cache_argument`)."""
    return {**kwargs, cache_argument(): cache}


def accepts_cache(model: torch.nn.Module, *also: str) -> bool:
    """Whether the model's forward takes a KV cache argument (a transformers 5 causal LM, by the name of
    :func:`cache_argument`), and the arguments named in ``also``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return all(name in params for name in (cache_argument(), *also))


def encode_once_per_group(
    model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, g: int,
    forward: Callable[[torch.Tensor, torch.Tensor, Any], Any] | None = None,
) -> tuple[Any, Any]:
    """Run ``forward(ids, mask, cache)`` over the distinct prompts (every ``g``-th row) into a fresh KV cache, then
    repeat the cache ``g`` times (autograd sums the rows' gradients back onto the shared prompt). Returns
    ``(cache, forward's output)``. The default forward predicts one token (``logits_to_keep=1``). ``(None, None)``,
    with no forward run, when the model's cache cannot be repeated (the recurrent state of linear-attention layers,
    Qwen3.5's): callers encode every row then."""
    from transformers import DynamicCache

    uniq_ids, uniq_mask = prompt_ids[::g], prompt_mask[::g]
    cache = DynamicCache(config=model.config)
    if not all(hasattr(layer, "batch_repeat_interleave") for layer in getattr(cache, "layers", [])):
        return None, None
    if forward is None:
        out = model(input_ids=uniq_ids, attention_mask=uniq_mask, position_ids=position_ids_from_mask(uniq_mask),
                    **with_cache(cache, use_cache=True, logits_to_keep=1))
    else:
        out = forward(uniq_ids, uniq_mask, cache)
    if g > 1:
        cache.batch_repeat_interleave(g)
    return cache, out


def common_prefix_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """How many tokens every left-padded row begins with after its padding, at most the shortest row's length minus
    one (every row keeps a token of its own after the prefix); 0 when a row is not left-padded (a 0 after a 1)."""
    n, p = prompt_ids.shape
    lengths = prompt_mask.long().sum(1)
    shortest = int(lengths.min()) if n else 0
    if n < 2 or shortest < 2:
        return 0
    pads = (p - lengths).unsqueeze(1)
    if not bool((prompt_mask.long().cumsum(1) == (torch.arange(p, device=prompt_ids.device) + 1 - pads).clamp(min=0))
                .all()):
        return 0  # not 0...0 1...1 in every row
    aligned = prompt_ids.gather(1, pads + torch.arange(shortest - 1, device=prompt_ids.device))
    differs = (aligned != aligned[:1]).any(0).nonzero()
    return int(differs[0]) if len(differs) else shortest - 1


def prefix_first(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows laid out as ``[the first length tokens][padding][the rest]``: the shared prefix in the same
    columns for every row. The positions (:func:`position_ids_from_mask`) and the tokens each one attends to are
    the left-padded rows' (padding is masked wherever it sits); the last column is unchanged."""
    p = prompt_ids.shape[1]
    pads = (p - prompt_mask.long().sum(1)).unsqueeze(1)
    col = torch.arange(p, device=prompt_ids.device).unsqueeze(0)
    source = torch.where(col < length, pads + col, torch.where(col < length + pads, col - length, col))
    return prompt_ids.gather(1, source), prompt_mask.gather(1, source)


MIN_SHARED_PREFIX = 4
"""Common prefixes shorter than this are encoded with each row (too little to save)."""


def encode_common_prefix_once(
    model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, g: int = 1,
    forward: Callable[[torch.Tensor, torch.Tensor, Any, torch.Tensor], Any] | None = None,
) -> tuple[Any, torch.Tensor, torch.Tensor, Any] | None:
    """A KV cache of left-padded prompts whose common first tokens (a chat template's system turn, say) are encoded
    once for the whole batch, the rest once per group of ``g`` identical prompts; returns ``(cache, ids, mask,
    out)``: ``ids`` / ``mask`` laid out by :func:`prefix_first` (the cache's columns; feed later steps with
    ``mask``) and ``out``, what ``forward(ids, mask, cache, position_ids)`` returned for the distinct prompts' rests
    (the default forward: the model's, one token predicted). The cache is repeated for the rows, so with gradients
    on, autograd sums every row's gradient back onto the one encoding of the prefix (the training forward,
    :mod:`grpokit.forward.logprobs`). None, with no forward run, when the rows share fewer than :data:`MIN_SHARED_PREFIX`
    tokens, hold one distinct prompt, or the cache cannot be repeated."""
    from transformers import DynamicCache

    uniq_ids, uniq_mask = prompt_ids[::g], prompt_mask[::g]
    length = common_prefix_length(uniq_ids, uniq_mask)
    cache = DynamicCache(config=model.config)
    if (length < MIN_SHARED_PREFIX or uniq_ids.shape[0] < 2
            or not all(hasattr(layer, "batch_repeat_interleave") for layer in getattr(cache, "layers", []))):
        return None
    if forward is None:
        def forward(ids, mask, cache, positions):
            return model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         **with_cache(cache, use_cache=True, logits_to_keep=1))
    ids, mask = prefix_first(prompt_ids, prompt_mask, length)
    uniq_ids, uniq_mask = ids[::g], mask[::g]
    positions = position_ids_from_mask(uniq_mask)
    forward(uniq_ids[:1, :length], uniq_mask[:1, :length], cache, positions[:1, :length])
    cache.batch_repeat_interleave(uniq_ids.shape[0])
    # every row keeps a token of its own after the prefix (common_prefix_length), so the rest is never empty
    out = forward(uniq_ids[:, length:], uniq_mask, cache, positions[:, length:])
    if g > 1:
        cache.batch_repeat_interleave(g)
    return cache, ids, mask, out
