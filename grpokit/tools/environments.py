"""``environment_factory`` (TRL 1.16's interface): every rollout gets an environment instance of its own.

- A factory is a callable with no argument returning an object with ``reset(**row)``: one factory, or a dict of
  them chosen per row by the dataset's ``environment`` column.
- ``reset(**row)`` gets the whole dataset row; a string it returns is appended to the prompt's last user message.
- Every other public method of the environment's class is a tool of that rollout, bound to its instance.
- ``get_reward()`` (optional) is one more reward source, logged under the class's name.
- Instances are pooled per factory and reused from batch to batch (made once, reset often).

Every call into an environment during a rollout is bounded by ``tool_timeout_s`` (:mod:`grpokit.bounds.user_calls`): a
``reset`` that passes it leaves the prompt without an observation, a ``get_reward`` gives the row ``None`` (or a
stop, as ``reward_timeout_action`` says); either is counted. An instance whose call was abandoned refuses further
calls while that call still runs, and the pool gives the next batch a fresh instance in its place.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from ..bounds.user_calls import CallBounds, CallTimeout, Incidents, call, call_many, is_busy
from ..rewards.scoring import RewardFunctionError, reward_timed_out
from .execution import truncate_result, without_images

logger = logging.getLogger("grpokit")

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

    def acquire(self, rows: list[dict], timeout_s: float | None = None) -> list:
        """One instance per row (pooled: the i-th row of a factory takes its i-th instance; one whose abandoned call
        still runs is replaced by a fresh one). Making one is bounded by ``timeout_s``."""
        used: dict[Any, int] = {}
        instances = []
        for row in rows:
            name = self.name_of(row)
            i = used.get(name, 0)
            used[name] = i + 1
            pool = self.pool[name]
            while len(pool) <= i:
                pool.append(self._make(name, timeout_s))
            if is_busy(pool[i]):
                pool[i] = self._make(name, timeout_s)
            instances.append(pool[i])
        return instances

    def _make(self, name: Any, timeout_s: float | None):
        where = f"environment_factory{'' if name is None else f'[{name!r}]'}"
        return call(self.factories[name], timeout_s=timeout_s, what=where)

    def reward_funcs(self) -> list[Callable]:
        """A reward function per environment class that has ``get_reward``: it scores the rows whose environment is
        of that class (others: None, not applicable)."""
        out, seen = [], set()
        for name in self.factories:
            cls = type(self.pool[name][0])
            if cls in seen or not callable(getattr(cls, "get_reward", None)):
                continue
            seen.add(cls)
            out.append(EnvironmentReward(cls))
        return out


class EnvironmentReward:
    """``get_reward()`` of the rollouts' environments of one class, as a reward function (TRL's calling convention):
    rows whose environment is of another class get None. Scoring calls :meth:`score_bounded`: every row's
    ``get_reward`` concurrently, within ``tool_timeout_s``."""

    def __init__(self, cls: type):
        self.cls = cls
        self.__name__ = self.__qualname__ = cls.__name__

    def __call__(self, environments=None, **kwargs) -> list:
        return [e.get_reward() if type(e) is self.cls else None for e in (environments or [])]

    def score_bounded(self, kwargs: dict[str, Any], bounds: CallBounds, incidents: Incidents) -> list:
        envs = list(kwargs.get("environments") or [])
        mine = [i for i, e in enumerate(envs) if type(e) is self.cls]
        what = f"{self.__name__}.get_reward()"
        values = call_many([envs[i].get_reward for i in mine], bounds.tool_timeout_s, [what] * len(mine),
                           [f" on row {i} of {len(envs)}" for i in mine], owners=[envs[i] for i in mine])
        out: list = [None] * len(envs)
        for i, value in zip(mine, values):
            if isinstance(value, CallTimeout):
                reward_timed_out(value, self.__name__, bounds, incidents)
            elif isinstance(value, Exception):
                raise RewardFunctionError(f"reward function {self.__name__!r} ({what}) raised "
                                          f"{type(value).__name__}: {value} on row {i} of {len(envs)}") from value
            else:
                out[i] = value
        return out


def reset_all(instances: list, rows: list[dict], bounds: CallBounds, incidents: Incidents) -> list:
    """Every row's ``reset(**row)``, one after another in row order (a reset drawing from a shared random generator
    stays deterministic), each within ``tool_timeout_s``: per row its observation, cut to ``max_tool_result_chars``
    (None where it timed out: counted, said, and the prompt gets no observation). A reset that raises stops the run,
    as before."""
    whats = [f"{type(e).__name__}.reset()" for e in instances]
    calls = [functools.partial(e.reset, **r) for e, r in zip(instances, rows)]
    values = call_many(calls, bounds.tool_timeout_s, whats, [f" on row {i} of {len(rows)}" for i in range(len(rows))],
                       concurrent=False, owners=instances)
    out = []
    for value, what in zip(values, whats):
        if isinstance(value, CallTimeout):
            incidents.count("tools/timeout_total")
            incidents.count("tools/reset/timeout_total")
            logger.warning("grpokit: %s; the prompt gets no observation and the environment no further calls while "
                           "the abandoned call runs", value)
            value = None
        elif isinstance(value, Exception):
            raise value
        value, images = without_images(value, what)
        if images:
            incidents.count("tools/images_dropped_total", images)
        value, cut = truncate_result(value, bounds.max_tool_result_chars)
        if cut:
            incidents.count("tools/truncated_total", cut)
        out.append(value)
    return out


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
