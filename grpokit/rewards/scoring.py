"""Calling reward functions and reward models on a batch of completions (TRL's calling convention).

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., trainer_state=...,
**dataset_columns)`` and returns one ``float`` or ``None`` ("not applicable") per completion. ``async`` functions
run concurrently. A reward model is a sequence-classification model whose first logit is the reward.

Rules (never a silent zero): a list, tuple, tensor or numpy array of exactly one value per completion; each value
a finite real number (Python, numpy or a one-element tensor) or ``None``. ``None`` means "not applicable": that
function is left out of the row's reward; a row every function skips gets advantage 0 and no gradient. NaN,
±inf, strings, booleans and a wrong count are errors naming the function and the row. A function that raises is
called again one row at a time to find the row that fails; the error names both.

Time bounds (:mod:`grpokit.bounds.user_calls`): each function's call on the batch, and each async function's coroutine,
gets ``reward_timeout_s``; one that passes it is counted (``rewards/<name>/timeout_total``) and its rows get ``None``
from it, or the batch carries a stop (``reward_timeout_action="stop"``). Reward models (grpokit's own forward)
are not bounded.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
from typing import Any

import torch

from ..bounds.user_calls import CallBounds, CallTimeout, Incidents, call, gather
from ..bounds.watchdog import stage
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


def _reward_error(name: str, func: Any, kwargs: dict[str, Any], n: int, error: BaseException,
                  timeout_s: float | None = None) -> RewardFunctionError:
    """Call ``func`` again one row at a time (each call within ``timeout_s``) to find the first row that fails on its
    own; not a scoring service that stops the run (:class:`~grpokit.rewards.service.RewardServiceError`: its message
    already names the cause)."""
    if isinstance(error, RewardServiceError):
        return RewardFunctionError(str(error))
    where = f" on the batch of {n} completions"
    for i in range(n):
        try:
            call(functools.partial(func, **_row_kwargs(kwargs, i, n)), timeout_s=timeout_s,
                 what=f"reward function {name!r}")
        except CallTimeout as timeout:
            where += f" (row {i} alone {str(timeout).removeprefix(f'reward function {name!r} ')})"
            break
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


def batch_where(prompts: list | None, n: int) -> str:
    """Where a call on a whole batch was: its rows and first prompt."""
    first = f"; first prompt {_snippet(prompts[0])}" if prompts else ""
    return f" on the batch of {n} completions (rows 0-{n - 1}{first})"


def reward_timed_out(error: CallTimeout, name: str, bounds: CallBounds, incidents: Incidents) -> None:
    """A reward call passed its bound: counted, said, and a stop when the config asks for one."""
    incidents.count(f"rewards/{name}/timeout_total")
    if bounds.reward_timeout_action == "stop":
        incidents.stop(f"{error} (reward_timeout_action='stop')", bounds)
        logger.error("grpokit: %s; the run stops after this batch (reward_timeout_action='stop')", error)
    else:
        logger.warning("grpokit: %s; it counts as None there (reward_timeout_action='none')%s", error,
                       "" if error.reason else "; the call is abandoned and may keep running in the background")


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
    bounds: CallBounds | None = None,
    incidents: Incidents | None = None,
    **call_kwargs: Any,
) -> torch.Tensor:
    """Rewards (N, K) of K functions for N completions; ``None`` becomes NaN. Errors name the function.

    Functions are called with ``prompts``, ``completions``, ``completion_ids``, every other column of ``rows`` by
    name, and ``call_kwargs`` (the trainer passes ``trainer_state``, ``log_metric`` and ``log_extra``, as TRL
    does). ``bounds``: the time bounds (default :class:`grpokit.bounds.user_calls.CallBounds`' defaults); timeouts are
    counted into ``incidents``. A run that is stopping (``bounds.stopping``) calls no function: every reward is NaN."""
    n = len(completions)
    bounds = bounds or CallBounds()
    incidents = incidents if incidents is not None else Incidents()
    columns = {k: [r[k] for r in rows] for k in (rows[0] if rows else {}) if k not in RESERVED_COLUMNS}
    gate = _LogGate(call_kwargs)
    try:
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **gate.kwargs, **columns)
        out = _score_all(reward_funcs, reward_processing_classes, kwargs, n, bounds, incidents)
    finally:
        gate.close()  # an abandoned call that logs later logs nothing
    _warn_unscored(out, prompts, completions, columns)
    return out


class _LogGate:
    """The trainer's ``log_metric`` / ``log_extra`` as the reward functions of one batch get them: open while the
    batch is scored, then closed, so an abandoned call that returns later cannot write into another batch's logs."""

    def __init__(self, call_kwargs: dict[str, Any]):
        self.open = True
        self.kwargs = {k: self._gated(v) if k in ("log_metric", "log_extra") and callable(v) else v
                       for k, v in call_kwargs.items()}

    def _gated(self, fn):
        def gated(*args, **kwargs):
            if self.open:
                return fn(*args, **kwargs)
            return None

        return gated

    def close(self) -> None:
        self.open = False


def _score_all(reward_funcs: list, reward_processing_classes: list, kwargs: dict[str, Any], n: int,
               bounds: CallBounds, incidents: Incidents) -> torch.Tensor:
    """:func:`score_completions`' work: every function on the batch, (N, K)."""
    prompts, completions = kwargs["prompts"], kwargs["completions"]
    nan_rows = [math.nan] * n
    results: dict[int, list[float]] = {}
    pending: dict[int, Any] = {}
    where = batch_where(prompts, n)
    for k, func in enumerate(reward_funcs):
        name = reward_func_name(func)
        if bounds.stopping:
            incidents.skipped(bounds)
            results[k] = nan_rows
            continue
        with stage("scoring", function=repr(name)):
            if callable(getattr(func, "score_bounded", None)):  # an environment's get_reward: bounded per row
                results[k] = _check_values(name, func.score_bounded(kwargs, bounds, incidents), n, prompts, completions)
                continue
            model = isinstance(func, torch.nn.Module)  # a reward model: its forward, under the same bound
            fn = (functools.partial(_reward_model_scores, func, reward_processing_classes[k], prompts, completions)
                  if model else functools.partial(func, **kwargs))
            try:
                value = call(fn, timeout_s=bounds.reward_timeout_s, what=f"reward {'model' if model else 'function'} "
                             f"{name!r}", where=where, await_result=False)
            except CallTimeout as e:
                reward_timed_out(e, name, bounds, incidents)
                results[k] = nan_rows
                continue
            except Exception as e:
                if model:
                    raise RewardFunctionError(f"reward model {name!r} raised {type(e).__name__}: {e}"
                                              f"{where}") from e
                raise _reward_error(name, func, kwargs, n, e, bounds.reward_timeout_s) from e
        if inspect.isawaitable(value):
            pending[k] = value
        else:
            results[k] = _check_values(name, value, n, prompts, completions)
    _score_pending(pending, reward_funcs, kwargs, n, where, bounds, incidents, results)
    return torch.tensor([results[k] for k in range(len(reward_funcs))], dtype=torch.float32).T.reshape(n, len(reward_funcs))


def _score_pending(pending: dict[int, Any], reward_funcs: list, kwargs: dict[str, Any], n: int, where: str,
                   bounds: CallBounds, incidents: Incidents, results: dict[int, list[float]]) -> None:
    """The async functions' coroutines, run together, each within ``reward_timeout_s``; results into ``results``."""
    if not pending:
        return
    names = {k: reward_func_name(reward_funcs[k]) for k in pending}
    with stage("scoring", function=", ".join(map(repr, names.values()))):
        values = gather(list(pending.values()), bounds.reward_timeout_s,
                        [f"reward function {names[k]!r}" for k in pending], where)
    prompts, completions = kwargs.get("prompts"), kwargs.get("completions")
    for k, value in zip(pending, values):
        if isinstance(value, CallTimeout):
            reward_timed_out(value, names[k], bounds, incidents)
            results[k] = [math.nan] * n
        elif isinstance(value, BaseException):
            raise _reward_error(names[k], reward_funcs[k], kwargs, n, value, bounds.reward_timeout_s) from value
        else:
            results[k] = _check_values(names[k], value, n, prompts, completions)


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
