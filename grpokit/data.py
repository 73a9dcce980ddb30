"""Prompt data for the trainer: dataset checks and prompt tokenisation (which prompts are visited in which order is
:mod:`grpokit.pipeline.prompts`).
"""

from __future__ import annotations

from typing import Any

import torch

CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",
                 "environments")
"""Keywords a reward function receives from the trainer (grpokit/rewards/scoring.py); a dataset column may not use
these names."""


def check_prompt_count(num_prompts: int, prompts_per_batch: int, how: str = "generation_batch_size / "
                       "num_generations") -> None:
    """One generation batch needs ``prompts_per_batch`` distinct prompts; fewer is an error naming the numbers."""
    if num_prompts < prompts_per_batch:
        raise ValueError(
            f"train_dataset has {num_prompts} prompts, fewer than the {prompts_per_batch} prompts of one generation "
            f"batch ({how}); add prompts or lower per_device_train_batch_size"
        )


def is_iterable_dataset(dataset) -> bool:
    """A dataset read as a stream (no ``len()``)."""
    return isinstance(dataset, torch.utils.data.IterableDataset)


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def prompt_text(prompt: Any, tokenizer, chat_template_kwargs: dict | None = None, tools: list | None = None) -> str:
    """A conversational prompt through the chat template (with the generation prompt, and ``tools`` when given);
    plain text as is."""
    if is_conversational(prompt):
        return tokenizer.apply_chat_template(
            prompt, tools=tools or None, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    if isinstance(prompt, str):
        return prompt
    raise ValueError(
        f"prompt {prompt!r:.80} is neither a string nor a list of chat messages ({{'role': ..., 'content': ...}})"
    )


def tokenize_prompts(
    texts: list[str], tokenizer, max_prompt_length: int | None, pad_id: int, conversational: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token ids, left-padded, left-truncated to ``max_prompt_length``. Returns ``(ids, mask, n_truncated)``.

    Chat-templated text already holds its special tokens, so none are added to it.
    """
    rows: list[list[int]] = []
    truncated = 0
    for text, conv in zip(texts, conversational):
        ids = tokenizer(text, add_special_tokens=not conv)["input_ids"]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            ids = ids[-max_prompt_length:]
            truncated += 1
        rows.append(ids)
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask, truncated


def check_dataset(name: str, dataset) -> None:
    """A dataset the trainer can use: not empty, with a ``prompt`` column (checked before a model is loaded)."""
    if dataset is None:
        return
    if is_iterable_dataset(dataset):  # a stream: only its declared columns can be checked before training
        columns = getattr(dataset, "column_names", None)
        if columns and "prompt" not in columns:
            raise ValueError(f"{name} has no 'prompt' column (columns: {', '.join(map(str, columns))}); add one")
        check_column_names(name, columns)
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and len(dataset):
        first = dataset[0]
        columns = list(first) if isinstance(first, dict) else None
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError(f"{name} is empty; it needs at least one prompt")
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"{name} has no 'prompt' column (columns: {', '.join(map(str, columns))}); add one")
    check_column_names(name, columns)


def check_column_names(name: str, columns) -> None:
    """A column named like a keyword reward functions already receive (``completions``, ``prompts``, ...) would
    reach them twice: an error naming it."""
    clash = sorted(set(map(str, columns or [])) & set(CALL_KEYWORDS))
    if clash:
        raise ValueError(f"{name} has column(s) {clash} named like keywords reward functions receive from the trainer "
                         f"({', '.join(CALL_KEYWORDS)}); rename them")
