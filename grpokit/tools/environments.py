"""``environment_factory`` (TRL 1.16's interface): every rollout gets an environment instance of its own.

- A factory is a callable with no argument returning an object with ``reset(**row)``: one factory, or a dict of
  them chosen per row by the dataset's ``environment`` column.
- ``reset(**row)`` gets the whole dataset row; a string it returns is appended to the prompt's last user message.
- Every other public method of the environment's class is a tool of that rollout, bound to its instance.
- ``get_reward()`` (optional) is one more reward source, logged under the class's name.
- Instances are pooled per factory and reused from batch to batch (made once, reset often).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_SPECIAL = ("reset", "get_reward")


def _methods(instance) -> list[str]:
    return [name for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if not name.startswith("_") and name not in _SPECIAL]


class Environments:
    def __init__(self, factory: Callable | dict[str, Callable]):
        self.factory = factory
        """As given (what a trainer is handed)."""
        self.factories = dict(factory) if isinstance(factory, dict) else {None: factory}
        self.by_row = isinstance(factory, dict)
        if not self.factories or not all(callable(f) for f in self.factories.values()):
            raise ValueError("environment_factory must be a callable (e.g. a class) or a dict of them")
        self.pool: dict[Any, list] = {}
        self.methods: dict[Any, list[str]] = {}
        for name, make in self.factories.items():
            where = f"environment_factory{'' if name is None else f'[{name!r}]'}"
            try:
                probe = make()
            except Exception as e:  # noqa: BLE001 - the user's factory failed: say which and why, in one line
                raise ValueError(f"{where} could not make an environment (it is called with no argument): "
                                 f"{type(e).__name__}: {e}") from e
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"{where} makes {type(probe).__name__}, which has no reset(**row) method; every "
                                 "environment needs one")
            self.pool[name] = [probe]
            self.methods[name] = _methods(probe)

    def name_of(self, row: dict) -> Any:
        if not self.by_row:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(f"a row has environment={name!r}, which is not among the environments passed to "
                             f"environment_factory ({', '.join(map(repr, self.factories))})")
        return name

    def tools_for(self, name: Any) -> list[Callable]:
        """The tools an environment offers, bound to its pooled instance (their schemas are what the prompt shows)."""
        probe = self.pool[name][0]
        return [getattr(probe, m) for m in self.methods[name]]

    def acquire(self, rows: list[dict]) -> list:
        """One instance per row (pooled: the i-th row of a factory takes its i-th instance), reset with the row."""
        used: dict[Any, int] = {}
        instances = []
        for row in rows:
            name = self.name_of(row)
            i = used.get(name, 0)
            used[name] = i + 1
            pool = self.pool[name]
            while len(pool) <= i:
                pool.append(self.factories[name]())
            instances.append(pool[i])
        return instances

    def reward_funcs(self) -> list[Callable]:
        """A reward function per environment class that has ``get_reward``: it scores the rows whose environment is
        of that class (others: None, not applicable)."""
        out, seen = [], set()
        for name in self.factories:
            cls = type(self.pool[name][0])
            if cls in seen or not callable(getattr(cls, "get_reward", None)):
                continue
            seen.add(cls)
            out.append(_environment_reward(cls))
        return out


def _environment_reward(cls) -> Callable:
    def reward(environments=None, **kwargs):
        return [e.get_reward() if type(e) is cls else None for e in (environments or [])]

    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


def reset_prompt(prompt: Any, observation: Any) -> Any:
    """The prompt with ``reset``'s observation appended to its last message's content (None: unchanged)."""
    if observation is None:
        return prompt
    if not isinstance(prompt, list) or not prompt:
        return (prompt or "") + str(observation)
    last = dict(prompt[-1])
    content = last.get("content") or ""
    if isinstance(content, list):
        content = content + ([{"type": "text", "text": observation}] if isinstance(observation, str) else observation)
    elif isinstance(observation, list):
        content = [{"type": "text", "text": content}] + observation
    else:
        content = content + str(observation)
    last["content"] = content
    return prompt[:-1] + [last]
