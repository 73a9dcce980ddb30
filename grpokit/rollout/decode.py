"""Sampling completions with a decode loop that drops finished rows: the transformers backend's fast path.

``generate`` runs every row of a batch until the longest one ends: a row that ended after 12 tokens keeps going
through the model, one padding token a step, while the others reach 32 or 48. On a CPU a decode step of 32 to 128
rows is compute-bound, so those rows cost nearly what live ones do. This loop runs the same model forward (the
transformers causal LM, its ``DynamicCache``) and the same distribution — the logits processors and warpers
``generate`` would apply, in its order, through transformers' own classes — but after each step it removes the rows
that produced an end-of-sequence token from the batch and from the cache (``batch_select_indices``), so the step
costs what the live rows cost.

With ``share_prompt`` the model runs once per distinct history, not once per row. A group's ``G`` rows begin as one
*state* (its prompt, encoded once; the tokens every prompt begins with, a chat template's system turn, once for the
call: :func:`grpokit.forward.prefix.encode_common_prefix_once`); each step every row draws its own token from its state's
distribution, and rows of a state that drew the same token stay one state (one forward, one cache row) while those
that drew others split off (the cache rows are copied: ``batch_select_indices``). The rows are sampled as before —
independent draws from the same distributions — but a policy that has grown confident (a group's four replies
alike, most of a trained model's groups) costs a quarter of the forwards.

It takes what the backend's fast sampler takes (temperature, top-k, top-p, min-p, repetition penalty,
``min_new_tokens``); anything else a config asks of ``generate`` (beams, static caches, bad words, ...) goes to
``generate`` itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from ..forward.prefix import accepts_cache, encode_common_prefix_once, position_ids_from_mask, with_cache
from .base import SamplingParams
from .llama_decode import llama_stepper
from .reserved_cache import reserve

DECODE_EXTRA = {"min_new_tokens"}
"""``generation_kwargs`` the loop applies itself; with any other one the backend calls ``generate``."""


def decodes(model: torch.nn.Module | None, params: SamplingParams) -> bool:
    """Whether :func:`decode` can sample for ``model`` (the causal LM itself, inside any PEFT/DDP wrapper) with
    ``params``: a transformers 5 causal LM taking a cache and ``logits_to_keep``, whose cache can drop rows, and no
    setting that only ``generate`` applies."""
    if model is None or set(params.extra) - DECODE_EXTRA or params.lockstep:
        return False
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "is_encoder_decoder", False) or not accepts_cache(model, "logits_to_keep"):
        return False
    cache = DynamicCache(config=cfg)
    return all(hasattr(layer, "batch_select_indices") and hasattr(layer, "batch_repeat_interleave")
               for layer in getattr(cache, "layers", [None]))


def token_chooser(params: SamplingParams, sampler=None, with_logps: bool = False) -> Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``choose(sequences, logits, owner) -> tokens``: ``sequences`` and ``logits`` one row per decode state, ``owner``
    (N,) each row's state, one token per row. The repetition penalty (when set), then either ``sampler`` (a
    :class:`grpokit.rollout.sampling.InverseCDFSampler`: the warpers once per state, one draw per row) or the argmax
    (greedy: every row of a state takes its argmax), as ``generate`` orders them. ``with_logps`` (a ``sampler``
    only): ``(tokens, logps)``, each token's log-prob under the distribution it was drawn from."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if with_logps and sampler is None:
        raise ValueError("with_logps needs a sampler: greedy decoding has no sampling distribution to report")

    def choose(sequences: torch.Tensor, logits: torch.Tensor, owner: torch.Tensor):
        scores = processors(sequences, logits) if processors else logits
        if sampler is not None:
            return sampler.draw(sequences, scores, owner, with_logps=with_logps)
        return scores.argmax(-1)[owner]

    return choose


@torch.no_grad()
def decode(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
           eos_ids: list[int], pad_id: int,
           choose: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
           min_new_tokens: int = 0, group: int = 1, share_prompt: bool = True, lean: bool = True,
           recorder=None, states: torch.Tensor | None = None, budget: torch.Tensor | None = None,
           logps: torch.Tensor | None = None, temperature: float = 1.0,
           interrupt: Callable[[torch.Tensor], bool] | None = None,
           sampled_logps: torch.Tensor | None = None) -> torch.Tensor:
    """Completions (N, T ≤ ``max_new_tokens``) for left-padded prompts, padded with ``pad_id`` after each row's
    end-of-sequence token; ``group``: rows come as groups of that many identical prompts; ``share_prompt``: encode
    what rows share once (a group's prompt, the prefix all prompts begin with), else every row whole; ``lean``: decode
    steps by :func:`grpokit.rollout.llama_decode.llama_step` where it applies (else the model's forward). ``model``:
    the causal LM (not a PEFT/DDP wrapper; PEFT's LoRA layers are inside it). ``recorder``: a Mixture-of-Experts
    policy's :class:`grpokit.moe.GenerationRoutes`, told which rows each step runs (the prompts are then prefilled
    whole, a group's once, without the prefix all of them share).

    For partial rollouts (:mod:`grpokit.rollout.partial_decode`): ``states`` (N,) non-decreasing, rows with equal
    values have equal prompts (instead of ``group``: any sizes); ``budget`` (N,) each row's most new tokens (at most
    ``max_new_tokens``); ``logps`` (N, ``max_new_tokens``) receives each sampled token's log-prob under the model's
    distribution at ``temperature`` (``log_softmax(logits / temperature)``, what the loss computes: no top-k/top-p);
    ``interrupt(rows)``, called after each step with the rows still running, stops the loop when it returns True
    (the completions so far come back: a row cut off this way has neither an end-of-sequence token nor its
    budget's length). ``sampled_logps`` (N, ``max_new_tokens``) receives each sampled token's log-prob under the
    distribution it was drawn from (``choose`` then returns ``(tokens, logps)``: :func:`token_chooser`'s
    ``with_logps``)."""
    n, p = prompt_ids.shape
    device = prompt_ids.device
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    out = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    if max_new_tokens <= 0:
        return out[:, :0]
    if states is None or not share_prompt:
        g = group if share_prompt and group > 1 else 1
        states = torch.arange(n, device=device) // g
    firsts = torch.unique_consecutive(states, return_counts=True)[1].cumsum(0) - 1  # (last row of each state)
    # The model runs on *states*: one per distinct history (a group's prompt, then each distinct way its rows went
    # on). ``owner[i]``: the state of live row ``rows[i]``.
    cache, mask = _prefill(model, prompt_ids[firsts], prompt_mask[firsts], share_prompt and recorder is None)
    reserve(cache, max_new_tokens)  # each step writes its position in place instead of copying the cache
    sequences = torch.cat([prompt_ids, out], 1)  # the rows so far, for processors that look back
    rows = torch.arange(n, device=device)  # the rows still running
    owner = torch.unique_consecutive(states, return_inverse=True)[1]
    step_input = prompt_ids[firsts, -1:]  # prompts are left-padded: every row's last column is a real token
    step = (llama_stepper(model) if lean else None) or (
        lambda ids, mask, positions, cache: model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                                  **with_cache(cache, use_cache=True, logits_to_keep=1)).logits[:, -1])
    for t in range(max_new_tokens):
        if recorder is not None:
            recorder.expect(rows, owner)  # row rows[i] runs in state owner[i]
        logits = step(step_input, mask, position_ids_from_mask(mask)[:, -1:], cache).float()
        if t < min_new_tokens:
            logits[:, eos] = float("-inf")
        one_each = _is_identity(owner, logits.shape[0])
        state_rows = rows if one_each else rows.new_empty(logits.shape[0]).scatter_(0, owner, rows)  # any row of it
        dist = torch.log_softmax(logits / temperature, -1) if logps is not None else None  # (before any warper)
        tokens = choose(sequences[state_rows, :p + t], logits, owner)  # each row its own draw from its state's
        if sampled_logps is not None:
            tokens, drawn_logps = tokens
            sampled_logps[rows, t] = drawn_logps.to(sampled_logps.dtype)
        out[rows, t] = tokens
        sequences[rows, p + t] = tokens
        if logps is not None:
            logps[rows, t] = dist[owner, tokens]
        running = ~torch.isin(tokens, eos)
        if budget is not None:
            running &= budget[rows] > t + 1
        if not bool(running.any()):
            return out[:, :t + 1]
        if not bool(running.all()):  # finished rows leave the batch
            keep = running.nonzero().flatten()
            rows, tokens, owner = rows[keep], tokens[keep], owner[keep]
        if interrupt is not None and interrupt(rows):
            return out[:, :t + 1]
        owner, step_input, parents = _next_states(owner, tokens, logits.shape[-1], mask.shape[0])
        if parents is not None:  # states split (rows drew different tokens) or ended: the cache follows
            cache.batch_select_indices(parents)
            mask = mask[parents]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
    return out


def _next_states(owner: torch.Tensor, tokens: torch.Tensor, vocab: int, n_states: int):
    """``(owner, step_input, parents)`` for the next step: one state per distinct (state, token) among the live rows
    — rows that shared a history and drew the same token still share it — ``owner`` mapping each row to its new
    state, ``step_input`` (S, 1) each state's token, and ``parents`` the old state each new one continues (None when
    that is every old state, in order: the cache is kept as it is)."""
    if _is_identity(owner, n_states):
        return owner, tokens.unsqueeze(1), None  # one row per state, all still running: nothing merges or splits
    keys, owner = torch.unique(owner * vocab + tokens, return_inverse=True)  # sorted by old state, then token
    parents = keys // vocab
    return owner, (keys % vocab).unsqueeze(1), None if _is_identity(parents, n_states) else parents


def _is_identity(index: torch.Tensor, n: int) -> bool:
    """Whether ``index`` is ``0, 1, ..., n - 1``."""
    return index.shape[0] == n and bool((index == torch.arange(n, device=index.device)).all())


def _prefill(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, share: bool):
    """``(cache, mask)``: a cache holding every prompt but its last token (fed by the first decode step), and the
    attention mask of the cache's columns plus that last token. With ``share``, the tokens all prompts begin with are
    encoded once for the batch (:func:`grpokit.forward.prefix.encode_common_prefix_once`: the mask then has each row's padding
    after that prefix); else every row whole."""
    if share and prompt_ids.shape[1] > 1:
        shared = encode_common_prefix_once(model, prompt_ids[:, :-1], prompt_mask[:, :-1])
        if shared is not None:
            cache, _, mask, _ = shared
            return cache, torch.cat([mask, prompt_mask[:, -1:]], 1)
    cache = DynamicCache(config=model.config)
    if prompt_ids.shape[1] > 1:
        ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
              **with_cache(cache, use_cache=True, logits_to_keep=1))
    return cache, prompt_mask.clone()
