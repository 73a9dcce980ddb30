"""Prompts in, scored completions out: the one path from dataset rows to rewards, shared by training and
held-out evaluation (tokenise → generate → decode → score)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..data import is_conversational, prompt_text, tokenize_prompts
from ..rewards.scoring import score_completions
from .base import Generation


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


def sample_and_score(
    rows: list[dict],
    tokenizer,
    generate: Callable[[torch.Tensor, torch.Tensor], Generation],
    reward_funcs: list,
    reward_processing_classes: list | None = None,
    *,
    chat_template_kwargs: dict | None = None,
    max_prompt_length: int | None = None,
    device: torch.device | str | None = None,
    reward_kwargs: dict[str, Any] | None = None,
) -> ScoredSamples:
    """Tokenise the rows' prompts (left-padded, left-truncated to ``max_prompt_length``), sample one completion per
    row with ``generate(prompt_ids, prompt_mask)``, decode, and score with every reward function (TRL's calling
    convention; the rows' other columns and ``reward_kwargs`` are passed by name)."""
    prompts = [r["prompt"] for r in rows]
    conversational = [is_conversational(p) for p in prompts]
    texts = [prompt_text(p, tokenizer, chat_template_kwargs) for p in prompts]
    prompt_ids, prompt_mask, n_cut = tokenize_prompts(texts, tokenizer, max_prompt_length, tokenizer.pad_token_id,
                                                      conversational)
    if device is not None:
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    generation = generate(prompt_ids, prompt_mask)
    id_lists = [row[m.bool()].tolist() for row, m in zip(generation.completion_ids, generation.completion_mask)]
    decoded = tokenizer.batch_decode(id_lists, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(decoded, conversational)]
    rewards = score_completions(
        reward_funcs, reward_processing_classes or [None] * len(reward_funcs), prompts=prompts,
        completions=completions, completion_ids=id_lists, rows=rows, **(reward_kwargs or {}),
    )
    return ScoredSamples(prompts=prompts, prompt_texts=texts, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                         generation=generation, completion_texts=decoded, completions=completions,
                         completion_id_lists=id_lists, rewards=rewards, n_truncated_prompts=n_cut)
