"""The multi-turn loop: after a first generation, every rollout whose reply calls tools gets the results appended as
a tool turn and generates again, up to ``max_tool_calling_iterations`` rounds, as TRL 1.16 does.

Tokens are never re-tokenised: the next prompt of a rollout is its prompt + its completion so far + the tool turn's
tokens (:class:`ToolTurnTokens`), and the completion grows by the tool turn and the new reply. ``tool_mask`` is 0 on
the tool turn's tokens (the model did not generate them: no loss, no entropy, not counted in lengths) and 1 on the
model's own. The whole completion — every reply and every tool turn — stays within ``max_completion_length``: a tool
turn that would not fit is rolled back (its calls were made and are counted) and the rollout ends; a reply is cut to
what is left. Each tool call is bounded by ``tool_timeout_s`` and each result cut to ``max_tool_result_chars``
(``bounds``, :mod:`grpokit.tools.execution`), so no call freezes the loop and no result is tokenised whole however
long it is; a run that is stopping (``bounds.stopping``) calls no more tools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..bounds.user_calls import CallBounds, Incidents
from ..bounds.watchdog import stage
from ..rollout.base import Generation, PromptBatch
from ..vision.encoding import tokenizer_of
from .execution import ToolResult, run_calls, tool_message
from .parsing import ParsedTurn, parse_turn
from .templates import ToolTurnTokens


@dataclass
class ToolRollouts:
    generation: Generation
    """Completions (every reply and tool turn), their validity mask, truncation, and ``tool_mask``."""
    messages: list[list[dict[str, Any]]]
    """Per rollout: its assistant and tool messages, in order (what reward functions get as the completion)."""
    calls: int
    failures: int


@dataclass
class _Rollout:
    prompt: list[int]
    tokens: list[int]
    mask: list[int]
    messages: list[dict[str, Any]]
    turn: ParsedTurn | None
    """The last reply, when it ended with EOS and called tools (the rollout continues); else None."""
    sampler: list[float] | None


def _valid(ids: torch.Tensor, mask: torch.Tensor, logps: torch.Tensor | None) -> list[tuple[list[int], list | None]]:
    rows = []
    for i in range(ids.shape[0]):
        keep = mask[i].bool()
        rows.append((ids[i][keep].tolist(), logps[i][keep].tolist() if logps is not None else None))
    return rows


def _parse(tokens: list[int], tokenizer, style: str, eos_ids: set[int]) -> tuple[ParsedTurn, bool]:
    """The reply's message and whether it asks for tools (only a finished reply, ending with EOS, does)."""
    parsed = parse_turn(tokenizer_of(tokenizer).decode(tokens, skip_special_tokens=True), style)
    finished = bool(tokens) and tokens[-1] in eos_ids
    return parsed, finished and bool(parsed.calls)


def run_tool_loop(
    generate: Callable[[PromptBatch, int], Generation],
    prompts: PromptBatch,
    first: Generation,
    tokenizer,
    tools_per_row: list[dict[str, Callable]],
    style: str,
    eos_ids: list[int],
    max_iterations: int | None,
    max_completion_length: int,
    max_model_len: int | None = None,
    chat_template_kwargs: dict | None = None,
    bounds: CallBounds | None = None,
    incidents: Incidents | None = None,
    environments: list | None = None,
) -> ToolRollouts:
    """Run the loop on ``first`` (the first replies to ``prompts``). ``generate(prompts, max_new_tokens)`` samples
    one reply per row of a :class:`grpokit.rollout.base.PromptBatch`; a batch with images passes the continuing rows'
    image tensors on (their token tensors extended over the turns so far) with their images. Images returned by
    tools are not supported (tool results are text). ``bounds`` (default:
    :class:`grpokit.bounds.user_calls.CallBounds`' defaults) bound each call and result; timeouts and cut results are
    counted into ``incidents``. ``environments``: each row's environment instance (calls on one are refused while
    an abandoned one runs)."""
    bounds = bounds or CallBounds()
    incidents = incidents if incidents is not None else Incidents()
    eos = set(eos_ids)
    turns = ToolTurnTokens(tokenizer, eos_ids, chat_template_kwargs)
    rollouts = []
    for (prompt, _), (tokens, lp) in zip(_valid(prompts.ids, prompts.mask, None),
                                         _valid(first.completion_ids, first.completion_mask, first.sampler_logps)):
        parsed, calls = _parse(tokens, tokenizer, style, eos)
        rollouts.append(_Rollout(prompt, tokens, [1] * len(tokens), [parsed.message()], parsed if calls else None, lp))
    n_calls = n_failures = rounds = 0
    while (any(r.turn is not None for r in rollouts) and (max_iterations is None or rounds < max_iterations)
           and not bounds.stopping):
        active = [i for i, r in enumerate(rollouts) if r.turn is not None]
        results = run_calls([rollouts[i].turn.calls for i in active], [tools_per_row[i] for i in active],
                            timeout_s=bounds.tool_timeout_s, max_chars=bounds.max_tool_result_chars, rows=active,
                            environments=[environments[i] for i in active] if environments else None)
        continuing, suffixes = [], {}
        for i, row_results in zip(active, results):
            r = rollouts[i]
            n_calls += len(row_results)
            n_failures += sum(res.failed for res in row_results)
            _count(row_results, incidents)
            msgs = [tool_message(res) for res in row_results]
            suffix = turns.suffix(msgs)
            total = len(r.prompt) + len(r.tokens) + len(suffix)
            r.turn = None
            if len(r.tokens) + len(suffix) >= max_completion_length or (max_model_len and total >= max_model_len):
                continue  # no room for the tool turn and a reply: rolled back, the rollout ends here
            r.messages += msgs
            suffixes[i] = (suffix, msgs)
            continuing.append(i)
        rounds += 1
        if continuing:
            _continue(generate, rollouts, continuing, suffixes, tokenizer, style, eos, max_completion_length,
                      _turn_images(prompts, rollouts, continuing, suffixes))
    generation = _pack(rollouts, tokenizer_of(tokenizer).pad_token_id, eos)
    generation.messages = [r.messages for r in rollouts]
    return ToolRollouts(generation=generation, messages=generation.messages, calls=n_calls, failures=n_failures)


def _count(results: list[ToolResult], incidents: Incidents) -> None:
    for res in results:
        if res.timed_out:
            incidents.count("tools/timeout_total")
            incidents.count(f"tools/{res.name}/timeout_total")
        if res.cut:
            incidents.count("tools/truncated_total", res.cut)
        if res.images:
            incidents.count("tools/images_dropped_total", res.images)


def _turn_images(prompts: PromptBatch, rollouts, continuing, suffixes) -> dict:
    """The continuing rows' image tensors and images for their next turn (nothing without images)."""
    if prompts.vision is None:
        return {}
    grown = [len(rollouts[i].tokens) + len(suffixes[i][0]) for i in continuing]
    return {"vision": prompts.vision.select(continuing).extend_tokens(grown),
            "images": [prompts.images[i] for i in continuing] if prompts.images is not None else None}


def _continue(generate, rollouts, continuing, suffixes, tokenizer, style, eos, max_completion_length,
              image_kwargs: dict) -> None:
    """Generate the next reply of every continuing rollout and append the tool turn and the reply."""
    prompts = [rollouts[i].prompt + rollouts[i].tokens + suffixes[i][0] for i in continuing]
    budgets = [max_completion_length - len(rollouts[i].tokens) - len(suffixes[i][0]) for i in continuing]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer_of(tokenizer).pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    with stage("generation", turn="after tool results"):
        out = generate(PromptBatch(ids, mask, **image_kwargs), max(budgets))
    for j, (tokens, lp) in enumerate(_valid(out.completion_ids, out.completion_mask, out.sampler_logps)):
        i = continuing[j]
        r = rollouts[i]
        tokens = tokens[:budgets[j]]
        suffix = suffixes[i][0]
        r.tokens += suffix + tokens
        r.mask += [0] * len(suffix) + [1] * len(tokens)
        if r.sampler is not None:
            r.sampler += [0.0] * len(suffix) + (lp[:budgets[j]] if lp is not None else [0.0] * len(tokens))
        parsed, calls = _parse(tokens, tokenizer, style, eos)
        if tokens:
            r.messages.append(parsed.message())
        r.turn = parsed if calls else None


def _pack(rollouts: list[_Rollout], pad_id: int, eos: set[int]) -> Generation:
    width = max(1, max(len(r.tokens) for r in rollouts))
    n = len(rollouts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    valid = torch.zeros((n, width), dtype=torch.long)
    tool_mask = torch.ones((n, width), dtype=torch.long)
    sampler = torch.zeros((n, width)) if all(r.sampler is not None for r in rollouts) else None
    for i, r in enumerate(rollouts):
        k = len(r.tokens)
        ids[i, :k] = torch.tensor(r.tokens, dtype=torch.long)
        valid[i, :k] = 1
        tool_mask[i, :k] = torch.tensor(r.mask, dtype=torch.long)
        if sampler is not None:
            sampler[i, :k] = torch.tensor(r.sampler)
    truncated = torch.tensor([not r.tokens or r.tokens[-1] not in eos for r in rollouts])
    return Generation(completion_ids=ids, completion_mask=valid, is_truncated=truncated, sampler_logps=sampler,
                      tool_mask=tool_mask)
