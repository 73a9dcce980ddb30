"""Per-token log-probs and entropies of completion tokens, without a (B, T, V) logits tensor.

The lean path runs the model's forward with its LM head projecting nothing (a pre-hook takes the head's input),
keeps the hidden state before each *valid* completion token (``completion_mask == 1``), and projects those to
the vocabulary in (rows × vocabulary-tile) blocks with an online log-sum-exp
(:func:`grpokit.forward.chunked_head.linear_logps_and_entropy`): at most one block of logits exists at a time, in the
forward and again (recomputed) in the backward, its matmuls in the autocast dtype. Models whose LM head cannot
be found, or whose logits are post-processed after the head (soft-capping, scaling), use the plain path:
``logits_to_keep`` logits and a row-chunked log-softmax.

Positions where ``completion_mask`` is 0 get log-prob 0 and entropy 0 on both paths.
"""

from __future__ import annotations

import copy

import torch

from ..algorithms.sampling_support import RowContext, SamplingSupport, held_stop_logps, support_logps
from ..moe.routers import has_routers
from .chunked_head import accumulation_dtype, linear_logps_and_entropy
from .fused_lora import fused_lora
from .prefix import (
    MIN_SHARED_PREFIX,
    accepts_cache,
    common_prefix_length,
    encode_common_prefix_once,
    encode_once_per_group,
    forward_position_ids,
    group_size,
    inner_causal_lm,
    position_ids_from_mask,
    with_cache,
)

_POSTPROCESSED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale",
                         "output_multiplier", "lm_head_multiplier")
"""Config fields of models that change logits after the LM head (Gemma 2/3, Cohere, Granite, ...)."""


# -- the plain path ----------------------------------------------------------------------------------------------
def token_logps_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, compute_entropy: bool = True,
    rows_per_chunk: int = 4, entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z/τ)[token]`` and the entropy ``H = logsumexp(z/τ) - Σ p·z/τ`` per position, from logits.

    ``logits``: (B, C, V); ``tokens``: (B, C). Entropy is computed without gradient (it is a metric, and the
    input of the high-entropy mask) unless ``entropy_grad`` (an entropy bonus in the loss).
    """
    logps, ents = [], []
    for start in range(0, logits.shape[0], rows_per_chunk):
        z = logits[start:start + rows_per_chunk].to(accumulation_dtype(logits.dtype))
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        picked = torch.gather(z, -1, tokens[start:start + rows_per_chunk].unsqueeze(-1)).squeeze(-1)
        logps.append(picked - lse)
        if compute_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                p = torch.softmax(z, dim=-1)
                ents.append(lse - (p * z).sum(-1))
    logp = torch.cat(logps) if logps else logits.new_zeros(tokens.shape, dtype=torch.float32)
    ent = (torch.cat(ents) if ents else torch.zeros_like(logp)) if compute_entropy else None
    return logp, ent


# -- finding the head -----------------------------------------------------------------------------------------------
def lean_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head of a decoder-only causal LM (DDP- or PEFT-wrapped or not) whose logits are exactly
    ``lm_head(hidden)``: a plain ``nn.Linear`` (tied or not, with or without bias) and no soft-capping or scaling
    after it. None when that cannot be established: the plain path is used. None under FSDP / ZeRO-3 too: there
    the head's weight is only whole inside its own forward (see ``grpokit.forward.sharding``)."""
    from .sharding import sharding_kind

    if sharding_kind(model) is not None:
        return None
    base = inner_causal_lm(model)
    if base is None or not hasattr(base, "get_output_embeddings"):
        return None
    cfg = getattr(base, "config", None)
    if cfg is None or getattr(cfg, "is_encoder_decoder", False):
        return None
    configs = [cfg] + ([cfg.get_text_config()] if hasattr(cfg, "get_text_config") else [])
    for c in configs:
        for name in _POSTPROCESSED_LOGITS:
            value = getattr(c, name, None)
            if value is not None and not (name != "final_logit_softcapping" and value == 1):
                return None
    try:
        head = base.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if type(head) is not torch.nn.Linear or not head.weight.dtype.is_floating_point:
        return None  # LoRA on the head, modules_to_save, quantised heads
    return head


def _router_kwargs(aux: list | None) -> dict:
    """A Mixture-of-Experts forward returns its load-balancing loss when asked (``aux``: where to put it)."""
    return {} if aux is None else {"output_router_logits": True}


def _keep_aux(outputs, aux: list | None) -> None:
    value = getattr(outputs, "aux_loss", None)
    if aux is not None and value is not None:
        aux.append(value)


def head_compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's matmul runs in where the model calls it: autocast's when the model's forward runs under
    autocast (accelerate wraps ``forward`` with it for ``bf16``/``fp16``; the head's chunked projection runs after the
    forward has returned, outside it), else the dtype of the hidden state and the weight as ``nn.Linear`` would
    combine them."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _head_inputs(
    model: torch.nn.Module, head: torch.nn.Linear, input_ids, mask, keep: int, cache=None, position_ids=None,
    aux: list | None = None, extra: dict | None = None, dtypes: list | None = None,
) -> torch.Tensor | None:
    """The hidden states the model hands its LM head for the last ``keep`` positions (B, keep, D), from a forward
    in which the head itself projects nothing: a pre-hook on the head keeps its input and passes on an empty slice.
    The model's own forward runs (so its wrappers do: DDP, PEFT, accelerate's autocast). None when the head was
    not called exactly once on a (B, keep, D) input. ``aux``: a list the forward's MoE router loss is added to.
    ``extra``: more keyword arguments of the forward (a VLM's image tensors). ``dtypes``: a list that receives the
    dtype the head would have computed in (:func:`head_compute_dtype`)."""
    dtypes = [] if dtypes is None else dtypes
    seen = []

    def hook(module, args):
        seen.append(args[0])
        dtypes.append(head_compute_dtype(args[0], module.weight))
        return (args[0][..., :0, :],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(hook)
    if position_ids is None:
        position_ids = position_ids_from_mask(mask)
    kwargs = dict(use_cache=False) if cache is None else with_cache(cache, use_cache=True)
    try:
        outputs = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=keep,
                        **kwargs, **_router_kwargs(aux), **(extra or {}))
    except TypeError:  # no logits_to_keep (or no cache)
        return None
    finally:
        handle.remove()
    _keep_aux(outputs, aux)
    if len(seen) != 1 or seen[0].dim() != 3 or seen[0].shape[:2] != (input_ids.shape[0], keep):
        return None
    return seen[0]


SHARE_PROMPTS_ON = ("cpu",)
"""Devices where the training forward encodes each prompt once per group. Measured faster on CPU (the step
benchmark, benchmarks/RESULTS.md); on CUDA two forwards and a repeated cache have not been measured to pay off yet
(benchmarks/bench_gpu.py compares both), so one forward per row is used there."""


def _shares_prompts(model: torch.nn.Module) -> bool:
    """Whether a prompt can be encoded once for its group: on a device of :data:`SHARE_PROMPTS_ON`; two forwards
    before one backward are fine (no DDP wrapper), no activation checkpointing (it turns the cache off), no active
    dropout (the rows of a group would share one dropout draw on the prompt), and a ``cache`` argument. Never under
    FSDP / ZeRO-3, where each rank's number of forwards must match (``grpokit.forward.sharding``)."""
    from .sharding import sharding_kind

    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or sharding_kind(model) is not None:
        return False
    param = next(model.parameters(), None)
    if param is None or param.device.type not in SHARE_PROMPTS_ON:
        return False
    base = inner_causal_lm(model)
    name = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"  # its name before transformers 5.20 (reading it now warns)
    if base is None or getattr(base, name, False) or has_routers(base):
        return False  # (a Mixture-of-Experts policy's forwards run whole rows: its routing is recorded and replayed so)
    if model.training:
        cfg = getattr(base, "config", None)
        if getattr(cfg, "attention_dropout", 0.0) or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in base.modules()
        ):
            return False
    return accepts_cache(base)


PREFIX_MIN_SAVED = 0.1
"""The training forward encodes the prefix all of a chunk's prompts begin with once only when that saves at least
this share of the positions its forwards run: a third forward and a cache repeated with its gradient cost more than
a few positions save. Measured on a 2-core AMD EPYC (SmolLM2-135M, float32, forward and backward, a 27-token system
turn): 2 prompts × 4 completions of 48 tokens (5.5% saved) slower with the prefix encoded once; 8 × 4 of 12 tokens
with LoRA (24% saved) faster (benchmarks/RESULTS.md, 'Measurements behind design choices')."""


def _prefix_pays(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: int, completion_len: int) -> bool:
    """For distinct prompts ``prompt_ids`` continued by ``rows`` completions of ``completion_len`` tokens."""
    length = common_prefix_length(prompt_ids, prompt_mask)
    total = prompt_ids.numel() + rows * completion_len
    return length >= MIN_SHARED_PREFIX and (prompt_ids.shape[0] - 1) * length >= PREFIX_MIN_SAVED * total


def _shared_prompt_head_inputs(model, head, prompt_ids, prompt_mask, completion_ids, completion_mask,
                               owner: torch.Tensor, aux: list | None = None, vision=None,
                               positions: torch.Tensor | None = None, dtypes: list | None = None):
    """The head inputs (B, C, D) for predicting each completion token, with each distinct prompt encoded once for
    the rows that continue it — ``owner`` (B,): non-decreasing, rows with the same value have the same prompt — and,
    without images, the tokens all the chunk's prompts begin with (a chat template's system turn) once for the chunk
    (:func:`grpokit.forward.prefix.encode_common_prefix_once`); then forwards over the completion tokens only, from the
    prompts' cache selected for the rows, in buckets of rows of similar length (:func:`length_buckets`), each as long
    as its longest row. The same numbers as encoding every row, up to float rounding; None when a
    forward does not fit. ``vision``: the rows' image tensors (a VLM), given to the prompt forward of each prompt's
    first row only; ``positions``: the whole rows' position ids (:func:`grpokit.forward.prefix.forward_position_ids`),
    sliced for both forwards."""
    c, p = completion_ids.shape[1], prompt_ids.shape[1]
    mask = torch.cat([prompt_mask, completion_mask], 1)
    if positions is None:
        positions = position_ids_from_mask(mask)
    counts = torch.unique_consecutive(owner, return_counts=True)[1]
    firsts = counts.cumsum(0) - counts  # each distinct prompt's first row
    uniq_ids, uniq_mask = prompt_ids[firsts], prompt_mask[firsts]
    shared = None
    if vision is None and _prefix_pays(uniq_ids, uniq_mask, owner.shape[0], c):
        # the tokens every prompt begins with (a system turn) once for the chunk, the rests once per prompt
        shared = encode_common_prefix_once(
            inner_causal_lm(model), uniq_ids, uniq_mask,
            forward=lambda ids, m, cache, pos: _head_inputs(model, head, ids, m, 1, cache=cache, position_ids=pos,
                                                            aux=aux, dtypes=dtypes))
    if shared is not None:
        cache, _, laid_out_mask, last = shared  # the cache's columns: the prefix, then each row's padding and rest
        mask = torch.cat([laid_out_mask[owner], completion_mask], 1)
    else:
        uniq_positions = positions[..., firsts, :p]
        uniq_extra = vision.select(firsts.tolist()).model_kwargs(p) if vision is not None else None
        cache, last = encode_once_per_group(  # `last` predicts completion token 0
            inner_causal_lm(model), uniq_ids, uniq_mask, 1,
            forward=lambda ids, m, cache: _head_inputs(model, head, ids, m, 1, cache=cache,
                                                       position_ids=uniq_positions, aux=aux, extra=uniq_extra,
                                                       dtypes=dtypes))
    if last is None:
        return None
    # the completions, in buckets of similar length (each row's padding after its last token is not run); autograd
    # sums the rows' gradients back onto their prompt's encoding
    ends = completion_mask.shape[1] - completion_mask.flip(1).long().argmax(1)
    ends = torch.where(completion_mask.any(1), ends, torch.zeros_like(ends))
    buckets = length_buckets(ends, BUCKET_OVERHEAD)
    parts = []
    for rows in buckets:
        width = max(1, int(ends[rows].max()))
        bucket_cache = cache
        if len(buckets) > 1:
            bucket_cache = copy.copy(cache)  # the layers are copied by the selection below, not shared
            bucket_cache.layers = [copy.copy(layer) for layer in cache.layers]
        _select_cache_rows(bucket_cache, owner[rows])
        rest = _head_inputs(model, head, completion_ids[rows, :width], mask[rows, :p + width], width,
                            cache=bucket_cache, position_ids=positions[..., rows, p:p + width], aux=aux, dtypes=dtypes)
        if rest is None:
            return None
        parts.append(torch.nn.functional.pad(rest[:, :-1], (0, 0, 0, c - width)))
    rest = torch.cat(parts) if len(parts) > 1 else parts[0]
    if len(buckets) > 1:
        rest = rest[torch.cat(buckets).argsort()]  # back in row order
    return torch.cat([_RowsOf.apply(last, owner), rest], 1)


def _select_cache_rows(cache, index: torch.Tensor) -> None:
    """``cache.batch_select_indices(index)``, the rows' keys and values selected by :class:`_RowsOf` where a layer is
    transformers' dynamic one (so the gradient the rows of a prompt send back is summed in a fixed order)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    for layer in cache.layers:
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) and layer.get_seq_length() > 0:
            layer.keys, layer.values = _RowsOf.apply(layer.keys, index), _RowsOf.apply(layer.values, index)
        else:
            layer.batch_select_indices(index)


BUCKET_OVERHEAD = 16
"""What one more forward of the completions costs, in positions run (forward and backward: its Python and small
ops cost as much as several positions do for SmolLM2-135M on a 2-core CPU; benchmarks/RESULTS.md, 'Measurements
behind design choices')."""


def length_buckets(lengths: torch.Tensor, overhead: int = BUCKET_OVERHEAD, candidates: int = 64) -> list[torch.Tensor]:
    """Rows split into buckets (index tensors) by length so that ``Σ (overhead + rows × the bucket's longest)`` is
    least: the forward of a batch right-padded to its longest row runs every row that long, and a few long replies
    among short ones (a confident policy's occasional ramble) would make every row that long. One bucket when
    splitting saves nothing. Dynamic programming over the rows sorted by length, cut only between distinct lengths
    (at most ``candidates`` places, spread by rank, for a batch with more distinct lengths)."""
    order = torch.sort(lengths, stable=True).indices
    ranked = [max(1, x) for x in lengths[order].tolist()]
    n = len(ranked)
    ends = [i for i in range(1, n + 1) if i == n or ranked[i] != ranked[i - 1]]  # a bucket may end after these
    if len(ends) > candidates:
        ends = sorted({ends[round(k * (len(ends) - 1) / (candidates - 1))] for k in range(candidates)})
    starts = [0] + ends[:-1]
    best, cut = {0: 0.0}, {}
    for i in ends:
        best[i], cut[i] = min((best[j] + overhead + (i - j) * ranked[i - 1], j) for j in starts if j < i)
    bounds, i = [], n
    while i > 0:
        bounds.append((cut[i], i))
        i = cut[i]
    if len(bounds) == 1:
        return [torch.arange(n, device=lengths.device)]
    return [order[j:i] for j, i in reversed(bounds)]


def distinct_rows(owner: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(kept, inverse)``: rows that continue the same prompt (``owner``) with the same completion are one forward —
    a confident policy's group often holds the same reply several times — so ``kept`` holds a row of each distinct
    (prompt, completion), ordered by prompt (``owner[kept]`` is non-decreasing: each prompt's rows stay together), and
    ``inverse`` (B,) each row's place among them. None when every row is distinct."""
    key = torch.cat([owner.unsqueeze(1), completion_ids * completion_mask, completion_mask], 1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)  # sorted: by owner first
    if distinct.shape[0] == key.shape[0]:
        return None
    kept = torch.empty(distinct.shape[0], dtype=torch.long, device=key.device)
    kept[inverse] = torch.arange(key.shape[0], device=key.device)  # any row of each (they are equal)
    return kept, inverse


def completion_logps(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    entropy_grad: bool = False,
    batch_size: int | None = None,
    lean: bool = True,
    share_prompts: bool = True,
    aux_losses: list | None = None,
    vision=None,
    support: SamplingSupport | None = None,
    on_support: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, C) of ``completion_ids`` given the prompts under ``model``, and entropies (B, C).

    Rows are processed ``batch_size`` at a time (all at once when None). Gradients flow when enabled by the
    caller. Positions where ``completion_mask`` is 0 get 0. ``lean=False`` forces the plain (logits) path.
    ``share_prompts``: rows that come as groups of identical consecutive prompts (the ``G`` completions of a
    prompt) encode their prompt once per group, and rows of a group with the same completion run once
    (:func:`distinct_rows`), on the lean path, when the model allows it (see :func:`_shares_prompts`): less compute and
    activation memory in the forward and the backward.
    ``aux_losses``: a list that receives the MoE load-balancing loss of every forward (Mixture-of-Experts models).
    ``vision``: the prompts' image tensors (:class:`grpokit.vision.VisionInputs`, one row per prompt row) for a
    vision-language model: every forward gets them, and positions are the model's own (M-RoPE); rows share a prompt
    encoding only when their image tensors are equal too.
    ``support`` and ``on_support``: a list that receives (B, C) the log-probs of the same tokens under the sampler's
    own distribution (:func:`grpokit.algorithms.sampling_support.support_logps`: its repetition penalty and
    ``min_tokens`` replayed, renormalised over the tokens its ``top_k`` / ``top_p`` / ``min_p`` keep), from the same
    forward, without gradient.
    """
    b, c = completion_ids.shape
    if c == 0:
        empty = completion_ids.new_zeros(completion_ids.shape, dtype=torch.float32)
        if on_support is not None:
            on_support.append(empty.clone())
        return empty, (empty.clone() if compute_entropy else None)
    head = lean_head(model) if lean else None
    # an MoE load-balancing loss is computed over the forward's whole attention mask: one forward per row then
    share = (share_prompts and aux_losses is None and head is not None and prompt_ids.shape[1] > 0
             and _shares_prompts(model))
    step = batch_size or b
    logps, ents, sups = [], [], []
    support = support if on_support is not None else None
    with fused_lora(model):  # (the trainer's training step holds it around the backward too: see GRPOTrainer)
        for start in range(0, b, step):
            sl = slice(start, start + step)
            rows = (prompt_ids[sl], prompt_mask[sl], completion_ids[sl], completion_mask[sl])
            vis = vision.select(range(start, min(b, start + step))) if vision is not None else None
            aux = [] if aux_losses is not None else None
            out = _lean_chunk(model, head, *rows, share, temperature, compute_entropy, entropy_grad, aux, vis,
                              support) if head else None
            if out is None:
                head = None  # this model does not fit the lean path: the plain path from now on
                aux = [] if aux_losses is not None else None
                out = _plain_chunk(model, *rows, temperature, compute_entropy, entropy_grad, aux, vis, support)
            if aux_losses is not None:
                aux_losses.extend(aux)
            logps.append(out[0])
            if out[1] is not None:
                ents.append(out[1])
            sups.append(out[2])
    if on_support is not None:
        on_support.append(torch.cat(sups) if len(sups) > 1 else sups[0])
    if len(logps) == 1:
        return logps[0], (ents[0] if compute_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if compute_entropy else None)


def _lean_chunk(model, head, prompt_ids, prompt_mask, completion_ids, completion_mask, share: bool,
                temperature: float, compute_entropy: bool, entropy_grad: bool, aux: list | None, vision=None,
                support: SamplingSupport | None = None):
    """Log-probs and entropies of one chunk of rows from the head's inputs; None when the model does not fit.

    With ``share``, rows that come as groups of one prompt encode it once (:func:`_shared_prompt_head_inputs`), and
    rows of a group with the same completion (:func:`distinct_rows`) are one row of the forward and the head, their
    values given to each (autograd sums their gradients)."""
    c = completion_ids.shape[1]
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    extra = vision.model_kwargs(prompt_ids.shape[1], c) if vision is not None else None
    positions = forward_position_ids(model, ids, mask, extra)
    # the same question about another picture is another prompt
    g = group_size(prompt_ids, prompt_mask, vision.equal_to_previous() if vision is not None else None) if share else 1
    owner = torch.arange(prompt_ids.shape[0], device=prompt_ids.device) // g if g > 1 else None
    rows = distinct_rows(owner, completion_ids, completion_mask) if owner is not None and vision is None else None
    if rows is not None:
        kept, inverse = rows
        prompt_ids, prompt_mask, completion_ids, completion_mask, ids, mask, owner = (
            t[kept] for t in (prompt_ids, prompt_mask, completion_ids, completion_mask, ids, mask, owner))
        positions = positions[..., kept, :]
    hidden = None
    dtypes: list[torch.dtype] = []  # the dtype the head would have run in, seen inside the model's forward
    if owner is not None:
        hidden = _shared_prompt_head_inputs(model, head, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                            owner, aux=aux, vision=vision, positions=positions, dtypes=dtypes)
    if hidden is None:
        if aux:
            aux.clear()
        hidden = _head_inputs(model, head, ids, mask, c + 1, position_ids=positions, aux=aux, extra=extra,
                              dtypes=dtypes)
        hidden = hidden[:, :-1] if hidden is not None else None
    if hidden is None:
        return None
    logps, ents = _head_logps(head, hidden, completion_ids, completion_mask.bool(), dtypes, temperature,
                              compute_entropy, entropy_grad)
    sup = None
    if support is not None:
        # log p(y) from a float32 head is what the stop tokens' hold-back corrects (held_stop_logps)
        exact = logps.detach() if _head_dtype(head, dtypes) == torch.float32 else None
        sup = _head_support_logps(head, hidden, prompt_ids, prompt_mask, completion_ids, completion_mask.bool(),
                                  temperature, support, logps=exact)
    if rows is None:
        return logps, ents, sup
    return (_RowsOf.apply(logps, inverse), (_RowsOf.apply(ents, inverse) if ents is not None else None),
            sup[inverse] if sup is not None else None)


class _RowsOf(torch.autograd.Function):
    """``x[index]`` along the first dimension, its backward summing the rows an index repeats with ``scatter_add``.
    Indexing's own backward (an accumulating ``index_put_``, atomic adds from several threads above 32k values) gave
    other bits from run to run where rows repeat (a prompt's cache rows for each of its completions) on a 2-core CPU,
    and two demo runs of one seed parted at step 18. The head inputs picked by the mask repeat no row; they take the
    same path so the backward has one kind of selection."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        g = g.contiguous()
        where = index.view(-1, *([1] * (g.dim() - 1))).expand_as(g)
        return g.new_zeros((ctx.rows, *g.shape[1:])).scatter_add_(0, where, g), None


def _head_logps(head, hidden, completion_ids, valid, dtypes, temperature: float, compute_entropy: bool,
                entropy_grad: bool):
    """Log-probs and entropies (B, C) from the head inputs (B, C, D), 0 where ``valid`` is False."""
    hidden = _RowsOf.apply(hidden.reshape(-1, hidden.shape[-1]), valid.reshape(-1).nonzero().squeeze(1))  # hidden[valid]
    # the blocks run in the dtype the forward ran the model in (its autocast: accelerate's for bf16=True), forward and
    # recomputed backward; float32 for a head cast there (cast_lm_head_to_fp32)
    dtype = _head_dtype(head, dtypes)
    lp_v, ent_v = linear_logps_and_entropy(hidden, head.weight, completion_ids[valid], head.bias,
                                           temperature=temperature, compute_entropy=compute_entropy,
                                           entropy_grad=entropy_grad, dtype=dtype)
    zeros = lp_v.new_zeros(valid.shape)
    return zeros.masked_scatter(valid, lp_v), (zeros.masked_scatter(valid, ent_v) if compute_entropy else None)


def _head_dtype(head, dtypes: list[torch.dtype]) -> torch.dtype:
    return torch.float32 if getattr(head, "grpokit_fp32", False) else dtypes[-1]


SUPPORT_BLOCK_BYTES = 64 * 2**20
"""The most float32 logits the support's log-probs hold at once (rows × vocabulary)."""


@torch.no_grad()
def _head_support_logps(head, hidden, prompt_ids, prompt_mask, completion_ids, valid, temperature: float,
                        support: SamplingSupport, logps: torch.Tensor | None = None) -> torch.Tensor:
    """(B, C) the valid tokens' log-probs on ``support`` from the head inputs (B, C, D), in float32, rows of the
    vocabulary's logits a block at a time (the kept set needs each whole row: top-p sorts it); 0 elsewhere.

    ``logps`` (B, C): the same tokens' float32 log-probs over the whole vocabulary. Where holding stop tokens back is
    all the sampler does (``min_tokens``), they are the answer past ``min_tokens`` and, before it, corrected from the
    stop tokens' logits alone (:func:`held_stop_logps`): no second pass over the vocabulary; a position where the
    stops held most of the mass takes the blocked pass."""
    w = head.weight.float()
    b = head.bias.float() if head.bias is not None else None
    if logps is not None and support.only_holds_stops:
        vocab = w.shape[0]
        stops = torch.tensor([i for i in support.stop_ids if i < vocab], dtype=torch.long, device=w.device)
        early = valid & (torch.arange(valid.shape[1], device=valid.device) < support.min_tokens)
        out = logps.float().masked_fill(~valid, 0.0)
        if not early.any() or not stops.numel():
            return out
        h, tokens = hidden[early].float(), completion_ids[early]
        drawn = (h * w[tokens]).sum(-1) + (b[tokens] if b is not None else 0.0)
        held = torch.nn.functional.linear(h, w[stops], b[stops] if b is not None else None)
        values, unsure = held_stop_logps(logps[early].float(), drawn / temperature, held / temperature, tokens, stops)
        out[early] = values
        if unsure.any():
            where = torch.zeros_like(early).masked_scatter(early, unsure)
            hu = hidden[where].float()
            exact = _blocked_support_logps(lambda rows: torch.nn.functional.linear(hu[rows], w, b), hu.shape[0],
                                           vocab, prompt_ids, prompt_mask, completion_ids, where, temperature, support)
            out[where] = exact[where]
        return out
    h = hidden[valid].float()
    return _blocked_support_logps(lambda rows: torch.nn.functional.linear(h[rows], w, b), h.shape[0], w.shape[0],
                                  prompt_ids, prompt_mask, completion_ids, valid, temperature, support)


def _blocked_support_logps(logits_of, n: int, vocab: int, prompt_ids, prompt_mask, completion_ids, valid,
                           temperature: float, support: SamplingSupport) -> torch.Tensor:
    """(B, C) :func:`support_logps` of the ``n`` valid positions (``valid``, (B, C)), ``logits_of(rows)`` giving the
    logits of the positions ``rows`` (a slice), :data:`SUPPORT_BLOCK_BYTES` of them at a time; 0 elsewhere."""
    tokens = completion_ids[valid]
    context = RowContext.of(prompt_ids, prompt_mask, completion_ids, valid) if support.reshapes else None
    rows = max(1, SUPPORT_BLOCK_BYTES // (4 * vocab))
    parts = [support_logps(logits_of(slice(i, i + rows)).float() / temperature, tokens[i:i + rows], support, context,
                           slice(i, i + rows)) for i in range(0, n, rows)]
    out = torch.zeros(valid.shape, dtype=torch.float32, device=completion_ids.device)
    if parts:
        out[valid] = torch.cat(parts)
    return out


def _plain_chunk(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float,
                 compute_entropy: bool, entropy_grad: bool, aux: list | None, vision=None,
                 support: SamplingSupport | None = None):
    """Log-probs and entropies of one chunk of rows from the model's logits."""
    c = completion_ids.shape[1]
    valid = completion_mask.bool()
    extra = vision.model_kwargs(prompt_ids.shape[1], c) if vision is not None else None
    logits = _forward_logits(model, torch.cat([prompt_ids, completion_ids], 1),
                             torch.cat([prompt_mask, completion_mask], 1), c + 1, aux=aux, extra=extra)[:, :-1]
    lp, ent = token_logps_and_entropy(logits, completion_ids, temperature, compute_entropy, entropy_grad=entropy_grad)
    sup = None
    if support is not None:
        with torch.no_grad():
            picked = logits[valid]
            sup = _blocked_support_logps(lambda rows: picked[rows], picked.shape[0], picked.shape[-1], prompt_ids,
                                         prompt_mask, completion_ids, valid, temperature, support)
    return lp.masked_fill(~valid, 0.0), (ent.masked_fill(~valid, 0.0) if ent is not None else None), sup


def _forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, keep: int,
                    aux: list | None = None, extra: dict | None = None) -> torch.Tensor:
    kwargs = dict(input_ids=input_ids, attention_mask=mask, position_ids=forward_position_ids(model, input_ids, mask, extra),
                  use_cache=False, **_router_kwargs(aux), **(extra or {}))
    try:
        outputs = model(**kwargs, logits_to_keep=keep)
    except TypeError:  # a model without logits_to_keep
        outputs = model(**kwargs)
    _keep_aux(outputs, aux)
    return outputs.logits[:, -keep:]
