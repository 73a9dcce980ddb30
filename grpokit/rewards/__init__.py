"""Reward functions (TRL's calling convention) and the registry that names them.

>>> from grpokit.rewards import get_reward_func
>>> get_reward_func("correctness")(prompts=None, completions=["2 + 2 = 4. Answer: 4."], answer=["4"])
[1.0]

Built-ins: ``correctness`` (1.0 for the right final ``Answer:``), ``format`` (0.2 for ending with
``Answer: <number>``), ``length`` (graded closeness to a ``target_words`` column) and
``word_count`` (1.0 for exactly ``target_words`` words). Any other function is reachable as
``"package.module:function"``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .answers import answers_match, extract_answer, extract_gsm8k_answer, parse_number
from .builtin import (
    FORMAT_REWARD,
    completion_text,
    correctness,
    count_words,
    format_reward,
    length,
    make_length_reward,
    word_count,
)

__all__ = [
    "FORMAT_REWARD",
    "REWARD_FUNCS",
    "answers_match",
    "completion_text",
    "correctness",
    "count_words",
    "extract_answer",
    "extract_gsm8k_answer",
    "format_reward",
    "get_reward_func",
    "length",
    "list_reward_funcs",
    "make_length_reward",
    "parse_number",
    "register_reward_func",
    "word_count",
]

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
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"Reward spec {spec!r} must look like 'package.module:function'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"Reward spec {spec!r}: cannot import module {module_name!r} ({error}).") from error
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"Reward spec {spec!r}: module {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"Reward spec {spec!r} names {type(obj).__name__} object, not a function.")
    return obj
