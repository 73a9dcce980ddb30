"""The reward registry: reward functions by name, the lookup of ``module:function`` specs and reward models, and
the names rewards are logged under. The one place reward functions are looked up."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..validation import refusal, short_repr
from .builtin import correctness, format_reward, length, word_count
from .classes import REWARD_CLASSES

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


def _reward_classes() -> dict[str, type]:
    """Every registered reward class (grpokit's own modules imported first: their classes register themselves)."""
    from . import code_execution, judge, remote_model  # noqa: F401

    return REWARD_CLASSES


def reward_from_mapping(spec: Any) -> RewardFunc:
    """A reward class's instance from its config form, a mapping of one class name to its arguments
    (``{"CodeExecution": {"timeout_s": 5}}``); every mistake is one error line naming the class and the option."""
    import difflib
    import inspect

    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"a reward_funcs entry that is a mapping names one class with its arguments, e.g. "
                         f"{{CodeExecution: {{timeout_s: 5}}}}; got {short_repr(spec)}")
    (name, args), = spec.items()
    classes = _reward_classes()
    if name not in classes:
        close = difflib.get_close_matches(str(name), list(classes), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"reward_funcs entry {{{name}: ...}}: unknown reward class{hint} (classes: "
                         f"{', '.join(sorted(classes))})")
    args = {} if args is None else args
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise ValueError(f"reward_funcs entry {{{name}: ...}}: its arguments must be a mapping of option: value, got "
                         f"{short_repr(args)}")
    cls = classes[name]
    options = [p for p in inspect.signature(cls).parameters if p != "self"]
    unknown = [k for k in args if k not in options]
    if unknown:
        close = difflib.get_close_matches(unknown[0], options, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"{name} has no option {unknown[0]!r}{hint} (options: {', '.join(options)})")
    missing = [p.name for p in inspect.signature(cls).parameters.values()
               if p.default is inspect.Parameter.empty and p.name not in args]
    if missing:
        raise ValueError(f"{name} needs {', '.join(missing)} (options: {', '.join(options)})")
    return cls(**args)


def check_reward_specs(specs: Any) -> None:
    """A config's ``reward_funcs``: a name, ``module:function``, a reward class mapping, or a list of them; the class
    mappings are built (which checks every argument) without importing torch."""
    items = specs if isinstance(specs, list) else [specs]
    if not items or not all(isinstance(s, (str, dict)) for s in items):
        raise refusal("reward_funcs", specs, "expected a reward name, module:function or a mapping "
                      f"{{Class: {{option: value}}}} ({', '.join(sorted(_reward_classes()))}), or a list of them")
    for i, item in enumerate(items):
        if isinstance(item, dict):
            try:
                reward_from_mapping(item)
            except (ValueError, ImportError) as e:
                where = f"reward_funcs[{i}]: " if isinstance(specs, list) else "reward_funcs: "
                raise ValueError(where + str(e)) from None


def get_reward_func(name_or_spec: str | dict | RewardFunc) -> RewardFunc:
    """A reward function by registry name (``"correctness"``), import spec (``"my_pkg.rewards:fn"``) or reward class
    mapping (``{"CodeExecution": {"timeout_s": 5}}``, :func:`reward_from_mapping`).

    A callable is returned unchanged. Importing a spec runs that module's code, as any import does;
    model outputs are never executed in this process (``CodeExecution`` runs code in a sandboxed child).
    """
    if callable(name_or_spec):
        return name_or_spec
    if isinstance(name_or_spec, dict):
        return reward_from_mapping(name_or_spec)
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
        if isinstance(f, dict):
            f = reward_from_mapping(f)
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
        raise refusal("reward_weights", reward_weights, f"{len(reward_weights)} weights for {len(names)} reward "
                      f"functions ({', '.join(names)}); give one per function")
