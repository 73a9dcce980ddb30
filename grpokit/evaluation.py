"""Held-out evaluation: generate one completion per prompt, score it, and report the mean reward and accuracy
with 95% intervals."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from typing import Any

import torch

from .bounds.user_calls import RunStopped
from .data import is_conversational
from .forward.sharding import weights_for_generation
from .pipeline.samples import sample_and_score
from .reporting import mean_ci95, wilson_interval
from .rewards import reward_func_name
from .rewards.answers import last_number, parse_number
from .rollout.base import SamplingParams, context_length, stop_token_ids
from .rollout.transformers_backend import TransformersRollout
from .tools import TurnLimits
from .vision.encoding import tokenizer_of
from .vision.inputs import pixel_dtype


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer,
    dataset,
    reward_funcs: list,
    *,
    accuracy_reward: str | None = None,
    max_new_tokens: int = 48,
    greedy: bool = True,
    temperature: float = 0.7,
    top_k: int = 0,
    top_p: float = 1.0,
    batch_size: int = 32,
    max_prompt_length: int | None = None,
    n: int | None = None,
    num_samples: int = 8,
    gather: bool = True,
    multiturn=None,
    max_completion_length: int | None = None,
    bounds=None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Score ``model`` on ``dataset`` (one completion per prompt, greedy by default, else sampled as training samples).

    Returns ``(summary, samples)``: ``summary`` has ``reward_mean``, ``reward_ci95``, ``accuracy`` (share of rows
    whose ``accuracy_reward`` function gave ≥ 1), ``accuracy_ci95`` (Wilson), ``n``, per-function means under
    ``rewards``, ``format_rate`` when a function named ``format`` exists, ``mean_length`` and ``seconds``;
    ``samples`` the first ``num_samples`` rows (prompt, completion, reward, answer, and ``correct``: whether the
    accuracy reward gave ≥ 1, None without one).

    ``multiturn`` (a :class:`grpokit.tools.MultiTurn`): rollouts with tools and environments, as in training, each
    reply up to ``max_new_tokens`` and all turns together up to ``max_completion_length`` (default
    ``max_new_tokens``); ``summary`` then has ``tool_calls_per_row`` and ``tool_failure_rate``.

    ``bounds``: time bounds on user code, as in training (a stop raises :class:`grpokit.bounds.user_calls.RunStopped`).

    ``batch_size`` prompts are generated together (more is faster where memory allows: on a 2-core CPU 128 rows of
    SmolLM2 take far less than 4× the time of 32, benchmarks/RESULTS.md), and a LoRA adapter is folded in once for all.

    Under multi-process training every rank evaluates every row; with sharded weights (FSDP, ZeRO-3) all ranks
    must call this together and ``gather`` decides how generation sees the weights (grpokit/forward/sharding.py).
    """
    start = time.perf_counter()
    rows = _eval_rows(dataset, n, model, tokenizer)
    device = next(model.parameters()).device
    rollout = TransformersRollout(tokenizer_of(tokenizer))  # ``tokenizer`` may be a VLM's processor
    params = SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, do_sample=not greedy)
    names = [reward_func_name(f) for f in reward_funcs]
    limits = TurnLimits(stop_token_ids(model, tokenizer), max_completion_length or max_new_tokens, context_length(model))
    all_rewards, lengths, texts_all, prompts_all, calls, failures = [], [], [], [], 0, 0
    with contextlib.ExitStack() as stack:
        weights = stack.enter_context(weights_for_generation(model, model, gather))  # gathered once for every batch
        params.lockstep = weights.lockstep
        if not weights.lockstep:  # the LoRA adapter merged once for every batch, not once per batch
            stack.enter_context(rollout.generation_batch(weights.model))

        def generate(prompts, max_new_tokens=None):
            p = params if max_new_tokens is None else dataclasses.replace(params, max_new_tokens=max_new_tokens)
            return rollout.generate(weights.model, prompts.ids, prompts.mask, p, **prompts.backend_kwargs())

        for s in range(0, len(rows), batch_size):
            out = sample_and_score(rows[s:s + batch_size], tokenizer, generate, reward_funcs,
                                   max_prompt_length=max_prompt_length, device=device, multiturn=multiturn,
                                   limits=limits, bounds=bounds, dtype=pixel_dtype(model))
            if out.incidents.stop_cause is not None:
                raise RunStopped(f"the evaluation stopped: {out.incidents.stop_cause}")
            all_rewards.append(out.rewards)
            lengths.extend(len(x) for x in out.completion_id_lists)
            multi = out.tool_calls is not None
            texts_all.extend([_as_text(c) for c in out.completions] if multi else out.completion_texts)
            prompts_all.extend(out.prompt_texts)
            calls += out.tool_calls or 0
            failures += out.tool_failures
    rewards = torch.cat(all_rewards)
    summary = {**_summary(rewards, names, lengths, accuracy_reward), **last_number_accuracy(rows, texts_all),
               "greedy": greedy}
    if multiturn is not None and multiturn.has_tools:
        summary["tool_calls_per_row"] = calls / len(rows)
        summary["tool_failure_rate"] = failures / calls if calls else 0.0
    summary["seconds"] = time.perf_counter() - start
    return summary, _samples(rows, texts_all, rewards, names, accuracy_reward, num_samples)


def _eval_rows(dataset, n: int | None, model, tokenizer) -> list[dict]:
    """The first ``n`` rows; an empty set, or rows with images the model cannot see (a text-only model, a VLM given a
    tokenizer instead of its processor), is an error."""
    from .vision.detection import check_vision_setup
    from .vision.images import image_column

    rows = [dataset[i] for i in range(len(dataset) if n is None else min(n, len(dataset)))]
    if not rows:
        raise ValueError("evaluation dataset is empty")
    check_vision_setup(model, tokenizer, image_column(list(rows[0])) is not None, dataset="the evaluation dataset")
    return rows


def _samples(rows: list, texts: list[str], rewards: torch.Tensor, names: list[str], accuracy_reward: str | None,
             num_samples: int) -> list[dict[str, Any]]:
    """The first ``num_samples`` rows as the report shows them."""
    values = torch.nansum(rewards, dim=1).tolist()
    correct = _correct_rows(rewards, names, accuracy_reward).tolist() if accuracy_reward is not None \
        else [None] * len(rows)
    return [
        {"prompt": _last_user_turn(rows[i]["prompt"]), "completion": texts[i], "reward": values[i],
         "answer": str(rows[i].get("answer", "")), "correct": correct[i]}
        for i in range(min(num_samples, len(rows)))
    ]


def last_number_accuracy(rows: list[dict], texts: list[str]) -> dict[str, Any]:
    """The format-free accuracy of rows whose ``answer`` is a number: the share of completions whose last number,
    wherever it stands and however it is written around, equals the answer (what the model knows, whether or not it
    followed the format the strict accuracy asks for). Empty when the answers are not all numbers."""
    answers = [parse_number(r.get("answer")) if isinstance(r.get("answer"), (str, int)) else None for r in rows]
    if not rows or any(a is None for a in answers):
        return {}
    right = sum(last_number(t) == a for t, a in zip(texts, answers))
    return {"last_number_accuracy": right / len(rows), "last_number_ci95": list(wilson_interval(right, len(rows))),
            "last_number_correct": right}


def _correct_rows(rewards: torch.Tensor, names: list[str], accuracy_reward: str) -> torch.Tensor:
    """Rows the accuracy reward scored ≥ 1 (a skipped row, NaN, is wrong)."""
    return torch.nan_to_num(rewards[:, names.index(accuracy_reward)], nan=0.0) >= 1.0 - 1e-6


def _summary(rewards: torch.Tensor, names: list[str], lengths: list[int], accuracy_reward: str | None
             ) -> dict[str, Any]:
    """Mean reward and accuracy with their 95% intervals, per-function means, the format rate and mean length."""
    total = torch.nansum(rewards, dim=1)
    n = rewards.shape[0]
    summary: dict[str, Any] = {
        "n": n,
        "reward_mean": float(total.mean()),
        "reward_ci95": list(mean_ci95(total.tolist())),
        "rewards": {name: _nanmean(rewards[:, k]) for k, name in enumerate(names)},
        "mean_length": sum(lengths) / len(lengths),
    }
    if accuracy_reward is not None:
        if accuracy_reward not in names:
            raise ValueError(f"accuracy_reward={accuracy_reward!r} is not among the reward functions {names}")
        correct = int(_correct_rows(rewards, names, accuracy_reward).sum())
        summary["accuracy"] = correct / n
        summary["accuracy_ci95"] = list(wilson_interval(correct, n))
        summary["correct"] = correct
    if "format" in names:
        summary["format_rate"] = float((torch.nan_to_num(rewards[:, names.index("format")]) > 0).float().mean())
    return summary


def _as_text(completion: Any) -> str:
    """A multi-turn completion (its messages, tool calls included) as one readable text for reports."""
    if not isinstance(completion, list):
        return str(completion)
    lines = []
    for m in completion:
        calls = [c.get("function", c) for c in m.get("tool_calls") or []]
        shown = " ".join(f"{c.get('name')}({json.dumps(c.get('arguments'))})" for c in calls)
        lines.append(f"[{m.get('role')}] {m.get('content') or ''}{' → ' + shown if shown else ''}")
    return "\n".join(lines)


def _nanmean(x: torch.Tensor) -> float | None:
    v = torch.nanmean(x).item()
    return None if math.isnan(v) else v


def _last_user_turn(prompt: Any) -> str:
    if is_conversational(prompt):
        users = [_content_text(m["content"]) for m in prompt if m.get("role") == "user"]
        return users[-1] if users else _content_text(prompt[-1].get("content", ""))
    return str(prompt)


def _content_text(content: Any) -> str:
    """A message's content as text; an image part as ``<image>``."""
    if not isinstance(content, list):
        return str(content)
    return "".join("<image>" if isinstance(p, dict) and p.get("type") == "image" else
                   str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
