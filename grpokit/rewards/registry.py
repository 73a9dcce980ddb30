"""The reward registry: reward functions by name, the lookup of ``module:function`` specs and reward models, and
the names rewards are logged under. The one place reward functions are looked up."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .builtin import correctness, format_reward, length, word_count

RewardFunc = Callable[..., list]

#: Built-in reward functions by name (the name is also the function's ``__name__``).
REWARD_FUNCS: dict[str, RewardFunc] = {
    "correctness": correctness,
    "format": format_reward,
    "length": length,
    "word_count": word_count,
}


def register_reward_func(func: RewardFunc | None = None, *, name: str | None = None):
    """Add a reward function to the registry, as a decorator (``@register_reward_func``) or a call.

    The registry name defaults to the function's ``__name__``; registering a different function
    under a taken name is an error.
    """

    def add(f: RewardFunc) -> RewardFunc:
        key = name or f.__name__
        if key in REWARD_FUNCS and REWARD_FUNCS[key] is not f:
            raise ValueError(f"A reward function named {key!r} is already registered.")
        REWARD_FUNCS[key] = f
        return f

    return add(func) if func is not None else add


def list_reward_funcs() -> list[str]:
    """Names of the registered reward functions, sorted."""
    return sorted(REWARD_FUNCS)


def get_reward_func(name_or_spec: str | RewardFunc) -> RewardFunc:
    """A reward function by registry name (``"correctness"``) or import spec (``"my_pkg.rewards:fn"``).

    A callable is returned unchanged. Importing a spec runs that module's code, as any import does;
    model outputs are never executed.
    """
    if callable(name_or_spec):
        return name_or_spec
    if not isinstance(name_or_spec, str) or not name_or_spec.strip():
        raise ValueError(
            f"A reward function is named by a string, got {name_or_spec!r}. "
            f"Built-ins: {', '.join(list_reward_funcs())}; or 'module:function'."
        )
    spec = name_or_spec.strip()
    if spec in REWARD_FUNCS:
        return REWARD_FUNCS[spec]
    if ":" not in spec:
        raise ValueError(
            f"Unknown reward function {spec!r}. Built-ins: {', '.join(list_reward_funcs())}; "
            f"or give 'module:function' for your own."
        )
    from ..imports import import_object

    obj = import_object(spec, "reward_funcs")
    if not callable(obj):
        raise ValueError(f"Reward spec {spec!r} names {type(obj).__name__} object, not a function.")
    return obj


def reward_func_name(func: Any) -> str:
    """The name a reward function or reward model is logged under (``rewards/<name>/mean``)."""
    import torch

    if isinstance(func, torch.nn.Module):
        name = getattr(getattr(func, "config", None), "_name_or_path", "") or type(func).__name__
        return name.rstrip("/").split("/")[-1]
    return getattr(func, "__name__", type(func).__name__)


def _load_reward_model(spec: str):
    import transformers

    return transformers.AutoModelForSequenceClassification.from_pretrained(
        spec, num_labels=1, use_safetensors=True, trust_remote_code=False)


def resolve_reward_funcs(reward_funcs: Any) -> list[Any]:
    """A reward function, reward model or name, or a list of them, as the list the trainer scores with. Strings are
    built-in names, ``module:function``, or a reward model's directory or hub id (a sequence-classification model
    whose first logit is the reward)."""
    import torch

    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty; give at least one reward function or reward model")
    out = []
    for f in funcs:
        if isinstance(f, str):
            try:
                f = get_reward_func(f)
            except ValueError:
                if not (os.path.isdir(f) or "/" in f):
                    raise
                f = _load_reward_model(f)
        if not (callable(f) or isinstance(f, torch.nn.Module)):
            raise ValueError(f"reward_funcs entry {f!r} is neither callable nor a model")
        out.append(f)
    return out


def check_reward_weights(reward_weights: list[float] | None, names: list[str]) -> None:
    """One weight per reward function, or none at all."""
    if reward_weights is not None and len(reward_weights) != len(names):
        raise ValueError(
            f"reward_weights={reward_weights!r} is not allowed: {len(reward_weights)} weights for {len(names)} "
            f"reward functions ({', '.join(names)}); give one per function"
        )
