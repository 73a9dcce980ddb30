"""Calling reward functions and reward models on a batch of completions (TRL's calling convention).

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., trainer_state=...,
**dataset_columns)`` and returns one ``float`` or ``None`` ("not applicable") per completion. ``async`` functions
run concurrently. A reward model is a sequence-classification model whose first logit is the reward.

Rules (never a silent zero): a list, tuple, tensor or numpy array of exactly one value per completion; each value
a finite real number (Python, numpy or a one-element tensor) or ``None``. ``None`` means "not applicable": that
function is left out of the row's reward; a row every function skips gets advantage 0 and no gradient. NaN,
±inf, strings, booleans and a wrong count are errors naming the function and the row. A function that raises is
called again one row at a time to find the row that fails; the error names both (not a scoring service that stops the
run, :class:`~grpokit.rewards.service.RewardServiceError`: its message already names the cause).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from typing import Any

import torch

from ..data import is_conversational
from .registry import reward_func_name
from .service import RewardServiceError

logger = logging.getLogger("grpokit")

RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")
"""Dataset columns that are not passed to reward functions under their own name."""


def _snippet(x: Any, width: int = 80) -> str:
    """A short readable form of a prompt or completion (the last message's content for chat lists)."""
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        x = x[-1].get("content", x[-1])
    text = x if isinstance(x, str) else repr(x)
    return repr(text if len(text) <= width else text[:width] + "…")


def _row_context(prompts: list | None, completions: list | None, i: int) -> str:
    parts = []
    if prompts is not None and i < len(prompts):
        parts.append(f"prompt {_snippet(prompts[i])}")
    if completions is not None and i < len(completions):
        parts.append(f"completion {_snippet(completions[i])}")
    return f" ({', '.join(parts)})" if parts else ""


def _check_values(name: str, values: Any, n: int, prompts: list | None = None,
                  completions: list | None = None) -> list[float]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().flatten().tolist()
    elif type(values).__module__ == "numpy" and hasattr(values, "tolist"):
        values = values.tolist()
        values = values if isinstance(values, list) else [values]
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"reward function {name!r} returned {type(values).__name__}; expected a list of {n} numbers")
    if len(values) != n:
        raise ValueError(f"reward function {name!r} returned {len(values)} values for {n} completions; expected one "
                         "number (or None) per completion")
    out: list[float] = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_complex and v.dtype != torch.bool:
            v = v.item()
        if v is None:
            out.append(math.nan)
            continue
        if isinstance(v, bool) or type(v).__name__ == "bool_" or not isinstance(v, numbers.Real):
            raise ValueError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) for row {i}"
                f"{_row_context(prompts, completions, i)}; expected a number or None"
            )
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(
                f"reward function {name!r} returned {v} for row {i}{_row_context(prompts, completions, i)}; rewards "
                "must be finite (return None for 'not applicable')"
            )
        out.append(v)
    return out


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function and, where one row alone fails, that row."""


def _row_kwargs(kwargs: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    return {k: ([v[i]] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in kwargs.items()}


def _reward_error(name: str, func: Any, kwargs: dict[str, Any], n: int, error: BaseException) -> RewardFunctionError:
    """Call ``func`` again one row at a time to find the first row that fails on its own."""
    where = f" on the batch of {n} completions"
    for i in range(n):
        try:
            value = func(**_row_kwargs(kwargs, i, n))
            if inspect.isawaitable(value):
                result = _run_async([value])[0]
                if isinstance(result, BaseException):
                    raise result
        except Exception as row_error:  # noqa: BLE001 - any failure of user code locates the row
            where = f" on row {i} of {n}{_row_context(kwargs.get('prompts'), kwargs.get('completions'), i)}"
            if type(row_error) is not type(error) or str(row_error) != str(error):
                where += f" (alone it raised {type(row_error).__name__}: {row_error})"
            break
    else:
        prompts = kwargs.get("prompts")
        first = f", first prompt {_snippet(prompts[0])}" if prompts else ""
        where += f" (every row alone scores without error{first})"
    return RewardFunctionError(f"reward function {name!r} raised {type(error).__name__}: {error}{where}")


@torch.no_grad()
def _reward_model_scores(model, tokenizer, prompts: list, completions: list) -> list[float]:
    texts = []
    for p, c in zip(prompts, completions):
        if is_conversational(p):
            texts.append(tokenizer.apply_chat_template(p + c, tokenize=False))
        else:
            texts.append(p + c)
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    device = next(model.parameters()).device
    logits = model(**{k: v.to(device) for k, v in enc.items()}).logits
    return logits[:, 0].float().cpu().tolist()


def score_completions(
    reward_funcs: list[Any],
    reward_processing_classes: list[Any],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    rows: list[dict],
    **call_kwargs: Any,
) -> torch.Tensor:
    """Rewards (N, K) of K functions for N completions; ``None`` becomes NaN. Errors name the function.

    Functions are called with ``prompts``, ``completions``, ``completion_ids``, every other column of ``rows`` by
    name, and ``call_kwargs`` (the trainer passes ``trainer_state``, ``log_metric`` and ``log_extra``, as TRL
    does)."""
    n = len(completions)
    columns = {k: [r[k] for r in rows] for k in (rows[0] if rows else {}) if k not in RESERVED_COLUMNS}
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **call_kwargs, **columns)
    results: dict[int, list[float]] = {}
    pending: dict[int, Any] = {}
    for k, func in enumerate(reward_funcs):
        name = reward_func_name(func)
        if isinstance(func, torch.nn.Module):
            scores = _reward_model_scores(func, reward_processing_classes[k], prompts, completions)
            results[k] = _check_values(name, scores, n, prompts, completions)
            continue
        try:
            value = func(**kwargs)
        except RewardServiceError as e:  # a service's own verdict, cause named: no row to look for
            raise RewardFunctionError(str(e)) from e
        except Exception as e:
            raise _reward_error(name, func, kwargs, n, e) from e
        if inspect.isawaitable(value):
            pending[k] = value
        else:
            results[k] = _check_values(name, value, n, prompts, completions)
    if pending:
        values = _run_async(list(pending.values()))
        for (k, _), value in zip(pending.items(), values):
            name = reward_func_name(reward_funcs[k])
            if isinstance(value, RewardServiceError):
                raise RewardFunctionError(str(value)) from value
            if isinstance(value, BaseException):
                raise _reward_error(name, reward_funcs[k], kwargs, n, value) from value
            results[k] = _check_values(name, value, n, prompts, completions)
    out = torch.tensor([results[k] for k in range(len(reward_funcs))], dtype=torch.float32).T.reshape(n, len(reward_funcs))
    _warn_unscored(out, prompts, completions, columns)
    return out


def _warn_unscored(rewards: torch.Tensor, prompts: list, completions: list, columns: dict[str, list]) -> None:
    """TRL's warning, for rows that every reward function skipped (advantage 0: they teach nothing), naming the
    first such row's columns."""
    unscored = torch.isnan(rewards).all(dim=1)
    if rewards.shape[1] == 0 or not unscored.any():  # no function at all: nothing was skipped
        return
    i = int(unscored.nonzero()[0, 0])
    row = {k: _snippet(v[i], 60) for k, v in columns.items()}
    row.update(prompt=_snippet(prompts[i], 60), completion=_snippet(completions[i], 60))
    logger.warning("All reward functions returned None for the following kwargs: %s (%d of %d completions unscored; "
                   "they get advantage 0 and no gradient). Make sure at least one reward function scores every row.",
                   ", ".join(f"{k}={v}" for k, v in row.items()), int(unscored.sum()), len(unscored))


def _run_async(awaitables: list) -> list:
    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    # Called from inside a running loop (a notebook): run in a private loop on a worker thread.
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()
