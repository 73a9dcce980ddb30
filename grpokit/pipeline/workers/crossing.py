"""What must cross into a rollout worker process, checked before the model loads: the user's reward functions, tools
and environment factory must pickle (``dill``: plain functions, lambdas, closures over plain data, objects whose
state pickles), and must not hold what cannot be shared with another process — a lock (each worker would get a
lock of its own, silently), an open socket or client connection, a generator. A ``rollout_func`` receives the trainer,
which stays in the learner's process, and a stream (``IterableDataset``) cannot be read ahead by index: both are
refused with workers."""

from __future__ import annotations

import io
import pickle
import threading
from typing import Any

import dill
import torch

from ...data import is_iterable_dataset
from ...validation import refusal

LOCKS = (type(threading.Lock()), type(threading.RLock()))


class _Strict(dill.Pickler):
    """Refuses locks; skips tensors (they cross through shared memory)."""

    def __init__(self, file):
        super().__init__(file, recurse=True)

    def persistent_id(self, obj):
        if isinstance(obj, LOCKS):
            raise pickle.PicklingError(f"it holds a lock ({type(obj).__module__}.{type(obj).__name__}), which another "
                                       "process cannot share")
        return "tensor" if isinstance(obj, torch.Tensor) else None


def why_not_crossing(obj: Any) -> str | None:
    """Why ``obj`` cannot cross into a worker process (one clause), or None when it can."""
    try:
        _Strict(io.BytesIO()).dump(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the user's to see, in one line
        return str(e) if isinstance(e, pickle.PicklingError) and "holds a lock" in str(e) else \
            f"{type(e).__name__}: {e}"
    return None


def _named(reward_funcs, tools, environment_factory) -> list[tuple[str, Any]]:
    from ...rewards.registry import reward_func_name

    funcs = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    named = [(f"reward_funcs[{i}] ({reward_func_name(f)!r})", f) for i, f in enumerate(funcs)
             if f is not None and not isinstance(f, str | torch.nn.Module)]
    named += [(f"tools[{i}] ({getattr(t, '__name__', type(t).__name__)!r})", t) for i, t in enumerate(tools or [])]
    if environment_factory is not None:
        named.append(("environment_factory", environment_factory))
    return named


def check_crossing(args, reward_funcs, tools, environment_factory, rollout_func, train_dataset) -> None:
    """With ``rollout_workers`` > 0: a ValueError naming the first thing that cannot cross into a worker, and why."""
    n = getattr(args, "rollout_workers", 0)
    if not n:
        return
    if rollout_func is not None:
        raise refusal("rollout_workers", n, "the rollout_func receives the trainer, which stays in the learner's "
                      "process; use rollout_workers=0", when="with a rollout_func")
    if is_iterable_dataset(train_dataset):
        raise refusal("rollout_workers", n, "workers read generation batches ahead by index; use a map-style Dataset",
                      when="with an IterableDataset train_dataset")
    for name, obj in _named(reward_funcs, tools, environment_factory):
        why = why_not_crossing(obj)
        if why is not None:
            raise ValueError(f"{name} cannot cross into a rollout worker process (rollout_workers={n}): {why}. What "
                             "runs in a worker must pickle: a plain function, a lambda or a closure over plain data, "
                             "not one holding a lock, a socket, a client connection or a generator (make those inside "
                             "the function), or set rollout_workers=0")
