"""``rollout_func(prompts, trainer)`` (TRL 1.16's interface): the user's own generation.

It receives this process's prompts as the dataset holds them (not templated), each one ``num_generations`` times in
a row, and returns a dict with ``prompt_ids``, ``completion_ids`` and ``logprobs`` (lists of lists, one per prompt;
``logprobs`` may be None). Optional: ``env_mask`` (1 for tokens the model generated, 0 for tokens it did not, used
as the tool mask when the trainer has no tools); every other key is an extra field passed to the reward functions
by name (a list: one value per prompt; anything else: the same value for every prompt). The log-probs are the
sampler's: with ``use_vllm`` they drive the mismatch correction, as in TRL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..rollout.base import Generation
from .samples import PreparedPrompts

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def _padded(rows: list[list], value, left: bool, dtype) -> torch.Tensor:
    width = max(1, max((len(r) for r in rows), default=0))
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            t = torch.tensor(r, dtype=dtype)
            if left:
                out[i, width - len(r):] = t
            else:
                out[i, :len(r)] = t
    return out


def call_rollout_func(rollout_func: Callable, prompts: list, trainer, tokenizer, eos_ids: list[int],
                      use_logprobs: bool, has_tools: bool) -> tuple[PreparedPrompts, Generation, dict[str, list]]:
    """Call the function and turn what it returns into prompts, a generation and the extra reward fields."""
    out = rollout_func(prompts, trainer)
    if not isinstance(out, dict):
        raise ValueError(f"rollout_func returned {type(out).__name__}; expected a dict with keys {list(REQUIRED_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in out]
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict")
    n = len(prompts)
    for key in ("prompt_ids", "completion_ids"):
        if len(out[key]) != n:
            raise ValueError(f"rollout_func returned {len(out[key])} {key} for {n} prompts; expected one per prompt")
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's
    prompt_rows = [list(map(int, p)) for p in out["prompt_ids"]]
    completion_rows = [list(map(int, c)) for c in out["completion_ids"]]
    pad = tokenizer.pad_token_id
    ids = _padded(prompt_rows, pad, left=True, dtype=torch.long)
    mask = _padded([[1] * len(p) for p in prompt_rows], 0, left=True, dtype=torch.long)
    completion_ids = _padded(completion_rows, pad, left=False, dtype=torch.long)
    completion_mask = _padded([[1] * len(c) for c in completion_rows], 0, left=False, dtype=torch.long)
    eos = set(eos_ids) | {pad}
    truncated = torch.tensor([not c or c[-1] not in eos for c in completion_rows])
    logprobs = out.get("logprobs")
    sampler = None
    if use_logprobs and logprobs is not None:
        sampler = _padded([[float("nan") if x is None else float(x) for x in row] for row in logprobs], 0.0,
                          left=False, dtype=torch.float32)
    extras = {k: v for k, v in out.items() if k not in REQUIRED_KEYS}
    tool_mask = None
    if "env_mask" in extras and not has_tools:
        tool_mask = _padded([list(map(int, m)) for m in extras.pop("env_mask")], 1, left=False, dtype=torch.long)
    fields = {k: (list(v) if isinstance(v, (list, tuple)) else [v] * n) for k, v in extras.items()}
    texts = tokenizer.batch_decode(prompt_rows, skip_special_tokens=False)
    prepared = PreparedPrompts(prompts=list(prompts), texts=texts, ids=ids, mask=mask, n_truncated=0)
    generation = Generation(completion_ids=completion_ids, completion_mask=completion_mask, is_truncated=truncated,
                            sampler_logps=sampler, tool_mask=tool_mask)
    return prepared, generation, fields


def merge_fields(rows: list[dict], fields: dict[str, list[Any]]) -> list[dict]:
    """The rows with ``rollout_func``'s extra fields, one value each."""
    return [dict(r, **{k: v[i] if i < len(v) else None for k, v in fields.items()}) for i, r in enumerate(rows)]
