"""Prompt data for the trainer: dataset checks and prompt tokenisation (which prompts are visited in which order is
:mod:`grpokit.pipeline.prompts`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .validation import refusal

logger = logging.getLogger("grpokit")

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

def check_datasets(args, train_dataset, eval_dataset) -> None:
    """Before a model is loaded: the datasets have prompts, and enough of them for one generation batch. A stream
    (``IterableDataset``) needs ``max_steps`` (its length is unknown) and every process reading it
    (``dispatch_batches=False``, no dataloader workers, which would interleave and split groups), as in TRL."""
    check_dataset("train_dataset", train_dataset)
    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    if any(is_iterable_dataset(d) for d in [train_dataset, *evals]):
        args.accelerator_config.dispatch_batches = no_dispatch(args)
    if args.max_staleness > 0:
        if is_iterable_dataset(train_dataset):
            raise ValueError("max_staleness > 0 is not supported with an IterableDataset train_dataset yet: the rollout "
                             "producer reads generation batches ahead by index; use a map-style Dataset")
    if is_iterable_dataset(train_dataset):
        if args.dynamic_sampling:
            raise ValueError("dynamic_sampling=True is not supported with an IterableDataset train_dataset yet: it draws "
                             "replacement prompts from the training set by index; use a map-style Dataset")
        if args.max_steps <= 0:
            raise refusal("max_steps", args.max_steps, "its length is unknown, so set max_steps to a positive number "
                          "of optimizer steps", when="with an IterableDataset train_dataset")
        if args.dataloader_num_workers:
            logger.warning("dataloader_num_workers=%d set to 0: workers would interleave the stream and split the "
                           "groups of num_generations completions", args.dataloader_num_workers)
            args.dataloader_num_workers = 0
    if eval_dataset is not None and not isinstance(eval_dataset, dict):
        check_dataset("eval_dataset", eval_dataset)
    from .vision.images import check_images

    for name, dataset in dataset_items(train_dataset, eval_dataset):
        check_images(dataset, name=name)  # every image read once: a missing file is one line naming row and file
    if train_dataset is not None and hasattr(train_dataset, "__len__"):
        check_prompt_count(len(train_dataset), args.generation_batch_size // args.num_generations,
                           f"generation_batch_size {args.generation_batch_size} / num_generations "
                           f"{args.num_generations}")


def no_dispatch(args) -> bool:
    """``dispatch_batches`` for a stream (``IterableDataset``): False, every process reads it; True is refused."""
    if args.accelerator_config.dispatch_batches is True:
        raise refusal("accelerator_config.dispatch_batches", True, "Iterable datasets require "
                      "`dispatch_batches=False` (every process reads the stream); use False or leave it unset")
    return False


def default_dataset(train_dataset, environment_factory, args):
    """Without a train_dataset, an environment that makes its own prompts trains on empty user turns (one
    generation batch of them, repeated), as in TRL; anything else needs a dataset."""
    if train_dataset is not None:
        return train_dataset
    if environment_factory is None:
        raise ValueError("`train_dataset` is required: pass a train_dataset, or an environment_factory whose "
                         "environments make their own prompts (with max_steps)")
    if isinstance(environment_factory, dict):
        raise ValueError("a dict environment_factory (several environments) needs a train_dataset with an "
                         "'environment' column saying which one each prompt uses")
    if args.max_steps <= 0:
        raise refusal("max_steps", args.max_steps, "set max_steps to a positive number of optimizer steps (the "
                      "environment makes the prompts)", when="without a train_dataset")
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] *
                                        (args.generation_batch_size // args.num_generations)})


def dataset_items(train_dataset, eval_dataset) -> list[tuple[str, object]]:
    """``(name, dataset)`` of the training set and every evaluation set (a dict of them named by key)."""
    items = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict):
        items += [(f"eval_dataset[{k!r}]", d) for k, d in eval_dataset.items()]
    else:
        items.append(("eval_dataset", eval_dataset))
    return [(n, d) for n, d in items if d is not None]

