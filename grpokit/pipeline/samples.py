"""Prompts in, scored completions out: the one path from dataset rows to rewards, shared by training and
held-out evaluation (tokenise → generate → decode → score)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..bounds.user_calls import CallBounds, CallTimeout, Incidents, call
from ..bounds.watchdog import stage
from ..data import is_conversational, prompt_text, tokenize_prompts
from ..moe.routers import unrecorded_index
from ..rewards.scoring import score_completions
from ..rollout.base import Generation, PromptBatch
from ..vision.detection import is_processor
from ..vision.encoding import encode_batch, tokenizer_of
from ..vision.inputs import VisionInputs
from ..vision.messages import place_images

logger = logging.getLogger("grpokit")


@dataclass
class ScoredSamples:
    """One completion per row, decoded and scored."""

    prompts: list
    """The rows' prompts as the dataset holds them (text, or a list of chat messages)."""
    prompt_texts: list[str]
    """The prompts as the model saw them (chat template applied)."""
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    generation: Generation
    completion_texts: list[str]
    completions: list
    """As reward functions receive them: text, or ``[{"role": "assistant", "content": ...}]`` for chat prompts."""
    completion_id_lists: list[list[int]]
    rewards: torch.Tensor
    """(N, K) one column per reward function; NaN where a function returned None."""
    n_truncated_prompts: int
    extra_columns: dict[str, list] = field(default_factory=dict)
    """Per-row columns reward functions logged with ``log_extra`` (for the completions table)."""
    tool_calls: int | None = None
    """Multi-turn rollouts: the tool calls made (None: no tools); ``tool_failures`` of them failed."""
    tool_failures: int = 0
    incidents: Incidents = field(default_factory=Incidents)
    """Timeouts and cut tool results while these samples were made (counters to log), and the cause of a stop the
    run must make (:mod:`grpokit.bounds.user_calls`)."""
    vision: VisionInputs | None = None
    """The prompts' image tensors (a vision-language model's batch with images), one row per row; None for text."""
    images: list[list] | None = None
    """Per row, its prompt's PIL images (for the completions table); None when no row has one."""

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, rows: list[int]) -> ScoredSamples:
        """The rows ``rows``, in that order."""
        idx = torch.as_tensor(rows, dtype=torch.long)

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx.to(t.device)]

        def pick(xs: list) -> list:
            return [xs[i] for i in rows]

        g = self.generation
        gen = Generation(completion_ids=take(g.completion_ids), completion_mask=take(g.completion_mask),
                         is_truncated=take(g.is_truncated), sampler_logps=take(g.sampler_logps),
                         tool_mask=take(g.tool_mask), messages=pick(g.messages) if g.messages is not None else None,
                         prompt_routes=take(g.prompt_routes), completion_routes=take(g.completion_routes))
        return ScoredSamples(prompts=pick(self.prompts), prompt_texts=pick(self.prompt_texts),
                             prompt_ids=take(self.prompt_ids), prompt_mask=take(self.prompt_mask), generation=gen,
                             completion_texts=pick(self.completion_texts), completions=pick(self.completions),
                             completion_id_lists=pick(self.completion_id_lists), rewards=take(self.rewards),
                             n_truncated_prompts=0, extra_columns={k: pick(v) for k, v in self.extra_columns.items()},
                             incidents=self.incidents, vision=self.vision.select(rows) if self.vision is not None else None,
                             images=pick(self.images) if self.images is not None else None)

    @staticmethod
    def concat(parts: list[ScoredSamples], pad_id: int) -> ScoredSamples:
        """The rows of every part, in order: prompts re-padded on the left, completions on the right."""
        if len(parts) == 1:
            return parts[0]
        def cat(name: str) -> list:
            return [x for p in parts for x in getattr(p, name)]

        gens = [p.generation for p in parts]
        sampler = None
        if all(g.sampler_logps is not None for g in gens):
            sampler = _cat_padded([g.sampler_logps for g in gens], 0.0, left=False)
        tool_mask = None
        if any(g.tool_mask is not None for g in gens):  # rows without one: every token the model's
            tool_mask = _cat_padded([g.tool_mask if g.tool_mask is not None else torch.ones_like(g.completion_mask)
                                     for g in gens], 1, left=False)
        messages = [m for p in parts for m in p.completions] if any(g.messages is not None for g in gens) else None
        routes = {}
        if all(g.prompt_routes is not None for g in gens):  # a Mixture-of-Experts sampler's recording, every part
            unrecorded = unrecorded_index(gens[0].prompt_routes.dtype)
            routes = {"prompt_routes": _cat_padded([g.prompt_routes for g in gens], unrecorded, left=True),
                      "completion_routes": _cat_padded([g.completion_routes for g in gens], unrecorded, left=False)}
        gen = Generation(completion_ids=_cat_padded([g.completion_ids for g in gens], pad_id, left=False),
                         completion_mask=_cat_padded([g.completion_mask for g in gens], 0, left=False),
                         is_truncated=torch.cat([g.is_truncated for g in gens]), sampler_logps=sampler,
                         tool_mask=tool_mask, messages=messages, **routes)
        columns = {k for p in parts for k in p.extra_columns}
        extra = {k: [x for p in parts for x in p.extra_columns.get(k, [None] * len(p))] for k in columns}
        incidents = Incidents()
        for p in parts:
            incidents.merge(p.incidents)
        vision = VisionInputs.cat([p.vision for p in parts], [len(p) for p in parts])
        images = None
        if any(p.images is not None for p in parts):
            images = [x for p in parts for x in (p.images if p.images is not None else [[]] * len(p))]
        return ScoredSamples(prompts=cat("prompts"), prompt_texts=cat("prompt_texts"),
                             prompt_ids=_cat_padded([p.prompt_ids for p in parts], pad_id, left=True),
                             prompt_mask=_cat_padded([p.prompt_mask for p in parts], 0, left=True), generation=gen,
                             completion_texts=cat("completion_texts"), completions=cat("completions"),
                             completion_id_lists=cat("completion_id_lists"),
                             rewards=torch.cat([p.rewards for p in parts]),
                             n_truncated_prompts=sum(p.n_truncated_prompts for p in parts), extra_columns=extra,
                             incidents=incidents, vision=vision, images=images)


def _cat_padded(tensors: list[torch.Tensor], value, left: bool) -> torch.Tensor:
    """Concatenate (N_i, W_i, ...) tensors along rows, padding dimension 1 of each to the widest on the left or the
    right."""
    width = max(t.shape[1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + ((width - t.shape[1], 0) if left
                                                                   else (0, width - t.shape[1])), value=value)
              for t in tensors]
    return torch.cat(padded)


@dataclass
class PreparedPrompts:
    prompts: list
    texts: list[str]
    ids: torch.Tensor
    mask: torch.Tensor
    n_truncated: int
    vision: VisionInputs | None = None
    """The rows' image tensors (a vision-language model's batch with images); None for text."""
    images: list[list] | None = None
    """Per row, its PIL images; None when no row of the batch has one."""

    @property
    def reward_prompts(self) -> list:
        """The prompts as reward functions receive them: conversational prompts of a batch with images hold their
        images in their image parts (TRL's ``prepare_multimodal_messages``)."""
        if self.images is None:
            return self.prompts
        return [place_images(p, imgs) if is_conversational(p) else p for p, imgs in zip(self.prompts, self.images)]

    @property
    def batch(self) -> PromptBatch:
        """What a generation call gets: the ids and mask, and the image tensors and images of a batch with images."""
        return PromptBatch(self.ids, self.mask, self.vision, self.images)


def prepare_prompts(rows: list[dict], tokenizer, *, chat_template_kwargs: dict | None = None,
                    max_prompt_length: int | None = None, device: torch.device | str | None = None,
                    tools_per_row: list[list] | None = None, dtype: torch.dtype | None = None) -> PreparedPrompts:
    """The rows' prompts through the chat template (with each row's tools, when given), tokenised, left-padded and
    left-truncated to ``max_prompt_length``. A vision-language model's processor (``tokenizer``) encodes the rows
    with their images (:func:`grpokit.vision.encode_batch`: each group once, a cut into an image refused); the
    image tensors go to ``device`` with their floating-point values in ``dtype`` (the model's)."""
    prompts = [r["prompt"] for r in rows]
    if is_processor(tokenizer):
        enc = encode_batch(tokenizer, rows, tools_per_row=tools_per_row, max_prompt_length=max_prompt_length,
                           chat_template_kwargs=chat_template_kwargs)
        ids, mask = (enc.prompt_ids, enc.prompt_mask) if device is None else (enc.prompt_ids.to(device),
                                                                              enc.prompt_mask.to(device))
        vision = enc.vision.to(device, dtype) if enc.vision is not None else None
        return PreparedPrompts(prompts=prompts, texts=enc.texts, ids=ids, mask=mask, n_truncated=enc.truncated,
                               vision=vision, images=enc.images if vision is not None else None)
    conversational = [is_conversational(p) for p in prompts]
    texts = [prompt_text(p, tokenizer, chat_template_kwargs, tools=tools_per_row[i] if tools_per_row else None)
             for i, p in enumerate(prompts)]
    ids, mask, n_cut = tokenize_prompts(texts, tokenizer, max_prompt_length, tokenizer.pad_token_id, conversational)
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
    return PreparedPrompts(prompts=prompts, texts=texts, ids=ids, mask=mask, n_truncated=n_cut)


def score_generation(rows: list[dict], prepared: PreparedPrompts, generation: Generation, tokenizer,
                     reward_funcs: list, reward_processing_classes: list | None = None, *,
                     reward_kwargs: dict[str, Any] | None = None, bounds: CallBounds | None = None,
                     incidents: Incidents | None = None) -> ScoredSamples:
    """Decode one completion per row and score it with every reward function (TRL's calling convention; the rows'
    other columns and ``reward_kwargs`` are passed by name). A multi-turn completion (``generation.messages``) reaches
    the reward functions as its list of messages. ``bounds``: the time bounds of the reward functions; timeouts are
    counted into ``incidents`` (the samples' own)."""
    incidents = incidents if incidents is not None else Incidents()
    id_lists = [row[m.bool()].tolist() for row, m in zip(generation.completion_ids, generation.completion_mask)]
    decoded = tokenizer_of(tokenizer).batch_decode(id_lists, skip_special_tokens=True)
    if generation.messages is not None:
        completions = generation.messages
    else:
        completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                       for t, p in zip(decoded, prepared.prompts)]
    rewards = score_completions(
        reward_funcs, reward_processing_classes or [None] * len(reward_funcs), prompts=prepared.reward_prompts,
        completions=completions, completion_ids=id_lists, rows=rows, bounds=bounds, incidents=incidents,
        **(reward_kwargs or {}),
    )
    return ScoredSamples(prompts=prepared.prompts, prompt_texts=prepared.texts, prompt_ids=prepared.ids,
                         prompt_mask=prepared.mask, generation=generation, completion_texts=decoded,
                         completions=completions, completion_id_lists=id_lists, rewards=rewards,
                         n_truncated_prompts=prepared.n_truncated, incidents=incidents, vision=prepared.vision,
                         images=prepared.images)


def sample_and_score(
    rows: list[dict],
    tokenizer,
    generate: Callable[..., Generation],
    reward_funcs: list,
    reward_processing_classes: list | None = None,
    *,
    chat_template_kwargs: dict | None = None,
    max_prompt_length: int | None = None,
    device: torch.device | str | None = None,
    reward_kwargs: dict[str, Any] | None = None,
    multiturn=None,
    limits=None,
    first_turn: Callable | None = None,
    bounds: CallBounds | None = None,
    dtype: torch.dtype | None = None,
) -> ScoredSamples:
    """One completion per row, scored: :func:`prepare_prompts`, ``generate(prompts, max_new_tokens=None)`` (a
    :class:`grpokit.rollout.base.PromptBatch`: with a vision-language model's processor as ``tokenizer``, a batch
    with images carries the image tensors, floating-point values in ``dtype``, and the images, every turn), then
    :func:`score_generation`.

    With ``multiturn`` (a :class:`grpokit.tools.MultiTurn`; ``limits`` its :class:`grpokit.tools.TurnLimits`) every
    row first gets its environment (reset with the row) and its tools in the prompt, and replies that call tools
    continue through the tool loop; reward functions get the environments. ``first_turn(rows, tools_per_row)``
    replaces the first step, returning ``(prepared, generation, rows)`` (the trainer's ``rollout_func``).

    ``bounds`` (:class:`grpokit.bounds.user_calls.CallBounds`, default its defaults) bound every call into user code:
    ``first_turn`` and the reward functions by ``reward_timeout_s``, tools and environments by ``tool_timeout_s``.
    A ``first_turn`` past its bound stops the run: the samples carry the cause (``incidents.stop_cause``), the rows
    get a one-token placeholder completion and no reward function is called."""
    bounds = bounds or CallBounds()
    incidents = Incidents()
    reward_kwargs = dict(reward_kwargs or {})
    session = multiturn.prepare(rows, bounds, incidents) if multiturn is not None else None
    if session is not None:
        rows = session.rows
        if session.environments is not None:
            reward_kwargs["environments"] = session.environments
    tools_per_row = session.tools_per_row if session is not None else None
    prompt_args = dict(chat_template_kwargs=chat_template_kwargs, max_prompt_length=max_prompt_length, device=device,
                       tools_per_row=tools_per_row, dtype=dtype)
    if first_turn is not None:
        prepared, generation, rows = _first_turn(first_turn, rows, tools_per_row, tokenizer, prompt_args, bounds,
                                                 incidents)
    else:
        prepared = prepare_prompts(rows, tokenizer, **prompt_args)
        with stage("generation"):
            generation = generate(prepared.batch)
    calls = failures = None
    if session is not None and multiturn.has_tools:
        turns = multiturn.loop(generate, prepared.batch, generation, session, tokenizer, limits, bounds, incidents)
        generation, calls, failures = turns.generation, turns.calls, turns.failures
    scored = score_generation(rows, prepared, generation, tokenizer, reward_funcs, reward_processing_classes,
                              reward_kwargs=reward_kwargs, bounds=bounds, incidents=incidents)
    scored.tool_calls, scored.tool_failures = calls, failures or 0
    return scored


def _first_turn(first_turn: Callable, rows: list[dict], tools_per_row, tokenizer, prompt_args: dict,
                bounds: CallBounds, incidents: Incidents) -> tuple[PreparedPrompts, Generation, list[dict]]:
    """``first_turn`` (``rollout_func``) within ``reward_timeout_s``; past it (or when the run is already stopping) a
    stop, and a placeholder: the rows' prompts and one end-of-sequence token each, which nothing trains on."""
    if bounds.stopping:
        incidents.skipped(bounds)
    else:
        try:
            with stage("rollout_func", rows=len(rows)):
                return call(first_turn, args=(rows, tools_per_row), timeout_s=bounds.reward_timeout_s,
                            what="rollout_func", where=f" on {len(rows)} prompts")
        except CallTimeout as e:
            incidents.count("rollout_func/timeout_total")
            incidents.stop(f"{e}; a rollout_func that times out stops the run (nothing to train on)", bounds)
            logger.error("grpokit: %s; the run stops after this batch (nothing to train on)", e)
    prepared = prepare_prompts(rows, tokenizer, **prompt_args)
    n = len(rows)
    tok = tokenizer_of(tokenizer)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
    generation = Generation(completion_ids=torch.full((n, 1), eos, dtype=torch.long),
                            completion_mask=torch.ones((n, 1), dtype=torch.long),
                            is_truncated=torch.zeros(n, dtype=torch.bool))
    return prepared, generation, rows
