"""Continuing completions where they stopped: the decode step of partial rollouts (``partial_rollouts=True``,
:mod:`grpokit.pipeline.partial`).

A completion cut off when new weights arrive (or when its batch had enough finished groups) is continued by encoding
its history — the prompt and the tokens it has so far — with the sampler's weights *now*, and decoding on from there.
The key-value cache is never carried from one version of the weights to the next: every token sampled after the
switch is drawn from the new version's distribution given the whole history, so its log-prob is that version's own.
Histories that are equal (a group's rows before they drew their first token) are encoded once and decode as one state
until they draw different tokens (:func:`grpokit.rollout.decode.decode`'s ``states``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..forward.prefix import inner_causal_lm
from .base import SamplingParams, stop_token_ids
from .decode import decode, decodes, token_chooser
from .sampling import fast_sampler


@dataclass
class Continued:
    """What one call added to each history."""

    tokens: list[list[int]]
    """Per row, the tokens sampled in this call."""
    logps: list[list[float]]
    """Per row, each of those tokens' log-probs under the weights that sampled it, at the run's temperature."""
    ended: list[bool]
    """Per row, whether the completion ended (an end-of-sequence token, or its budget of new tokens reached)."""


def why_not_continued(backend, model: torch.nn.Module, params: SamplingParams) -> str | None:
    """Why ``backend`` cannot continue completions of ``model`` with ``params`` (None: it can)."""
    from ..forward.sharding import sharding_kind
    from .transformers_backend import TransformersRollout

    if type(backend) is not TransformersRollout:
        return f"the rollout backend is {type(backend).__name__}; partial rollouts continue completions with " \
               "grpokit's decode loop (the transformers backend)"
    if sharding_kind(model) is not None:
        return "the policy's weights are sharded (FSDP / ZeRO-3); partial rollouts need whole weights to decode"
    if params.do_sample and fast_sampler(params, torch.device("cpu")) is None:
        return "these sampling settings are not ones grpokit's decode loop samples"
    if not decodes(inner_causal_lm(model), params):
        return f"{type(model).__name__} is not a causal LM grpokit's decode loop runs (a transformers 5 causal LM " \
               "whose cache can drop rows)"
    return None


@torch.no_grad()
def continue_rows(backend, model: torch.nn.Module, histories: list[list[int]], budgets: list[int],
                  params: SamplingParams, temperature: float, device: torch.device,
                  interrupt: Callable[[torch.Tensor], bool] | None = None) -> Continued:
    """Sample on from each history (a row's prompt and completion so far, token ids) for at most its budget of new
    tokens, with ``model``'s weights as they are now; rows with equal histories must be adjacent to share a state.
    ``interrupt(rows)`` (the rows still running, after each step) stops the call when it returns True. ``backend``:
    the run's :class:`grpokit.rollout.transformers_backend.TransformersRollout` (its packing, prefix sharing and
    tokenizer)."""
    from .transformers_backend import contiguous_head_input, decoding_weights

    n = len(histories)
    width = max(len(h) for h in histories)
    pad = backend.tokenizer.pad_token_id
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, h in enumerate(histories):  # left-padded, as prompts are
        ids[i, width - len(h):] = torch.tensor(h, dtype=torch.long)
        mask[i, width - len(h):] = 1
    ids, mask = ids.to(device), mask.to(device)
    states = torch.tensor([0] + [int(histories[i] != histories[i - 1]) for i in range(1, n)], device=device).cumsum(0)
    budget = torch.tensor(budgets, dtype=torch.long, device=device)
    most = int(budget.max())
    logps = torch.zeros((n, most), dtype=torch.float32, device=device)
    sampler = fast_sampler(params, device)
    choose = token_chooser(params, sampler if params.do_sample else None)
    eos = stop_token_ids(model, backend.tokenizer)
    was_training = model.training
    model.eval()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(decoding_weights(model, backend.pack_weights, n))
            stack.enter_context(contiguous_head_input(model))
            out = decode(inner_causal_lm(model), ids, mask, max_new_tokens=most, eos_ids=eos, pad_id=pad,
                         choose=choose, share_prompt=backend.share_prompt_prefill, states=states, budget=budget,
                         logps=logps, temperature=temperature, interrupt=interrupt)
    finally:
        model.train(was_training)
    steps = out.shape[1]
    is_eos = torch.isin(out, torch.tensor(eos, device=out.device))
    tokens, values, ended = [], [], []
    for i in range(n):
        limit = min(steps, budgets[i])
        hits = is_eos[i, :limit].nonzero()
        count = int(hits[0]) + 1 if hits.numel() else limit
        tokens.append(out[i, :count].tolist())
        values.append(logps[i, :count].tolist())
        ended.append(bool(hits.numel()) or count == budgets[i])
    return Continued(tokens=tokens, logps=values, ended=ended)
