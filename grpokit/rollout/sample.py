"""Prompts in, scored completions out: the one path from dataset rows to rewards, shared by training and
held-out evaluation (tokenise → generate → decode → score)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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
    extra_columns: dict[str, list] = field(default_factory=dict)
    """Per-row columns reward functions logged with ``log_extra`` (for the completions table)."""

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
                         is_truncated=take(g.is_truncated), sampler_logps=take(g.sampler_logps))
        return ScoredSamples(prompts=pick(self.prompts), prompt_texts=pick(self.prompt_texts),
                             prompt_ids=take(self.prompt_ids), prompt_mask=take(self.prompt_mask), generation=gen,
                             completion_texts=pick(self.completion_texts), completions=pick(self.completions),
                             completion_id_lists=pick(self.completion_id_lists), rewards=take(self.rewards),
                             n_truncated_prompts=0, extra_columns={k: pick(v) for k, v in self.extra_columns.items()})

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
        gen = Generation(completion_ids=_cat_padded([g.completion_ids for g in gens], pad_id, left=False),
                         completion_mask=_cat_padded([g.completion_mask for g in gens], 0, left=False),
                         is_truncated=torch.cat([g.is_truncated for g in gens]), sampler_logps=sampler)
        columns = {k for p in parts for k in p.extra_columns}
        extra = {k: [x for p in parts for x in p.extra_columns.get(k, [None] * len(p))] for k in columns}
        return ScoredSamples(prompts=cat("prompts"), prompt_texts=cat("prompt_texts"),
                             prompt_ids=_cat_padded([p.prompt_ids for p in parts], pad_id, left=True),
                             prompt_mask=_cat_padded([p.prompt_mask for p in parts], 0, left=True), generation=gen,
                             completion_texts=cat("completion_texts"), completions=cat("completions"),
                             completion_id_lists=cat("completion_id_lists"),
                             rewards=torch.cat([p.rewards for p in parts]),
                             n_truncated_prompts=sum(p.n_truncated_prompts for p in parts), extra_columns=extra)


def _cat_padded(tensors: list[torch.Tensor], value, left: bool) -> torch.Tensor:
    """Concatenate (N_i, W_i) tensors along rows, padding each to the widest on the left or the right."""
    width = max(t.shape[1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)
              for t in tensors]
    return torch.cat(padded)


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
