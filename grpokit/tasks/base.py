"""The :class:`Task` record and small helpers shared by the built-in tasks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset

__all__ = ["ANSWER_INSTRUCTION", "Task", "split_holdout", "user_turn"]

#: Appended to every question of the answer-graded tasks; the ``format`` reward checks for it.
ANSWER_INSTRUCTION = "End your reply with the line 'Answer: <number>'."


@dataclass
class Task:
    """A training task: data with verifiable answers, and the rewards that grade it.

    Attributes:
        name: the task's name (``"arithmetic"``, ``"file:data.jsonl"``, ...).
        train_dataset: rows with a conversational ``prompt`` (``[{"role": "user", "content": ...}]``)
            and the columns the rewards read (``answer``, ``target_words``).
        eval_dataset: held-out rows, disjoint from ``train_dataset`` by prompt.
        reward_funcs: reward functions in TRL's calling convention; their sum is the reward.
        accuracy_reward: ``__name__`` of the 0/1 reward among ``reward_funcs`` whose mean is the
            task's accuracy (``"correctness"``).
        description: one paragraph for people: what is asked and how it is scored.
        tools: functions the model may call (multi-turn tasks), as ``GRPOTrainer(tools=...)`` takes them.
        environment_factory: one environment per rollout, as ``GRPOTrainer(environment_factory=...)`` takes it.
        chat_template: a chat template the task needs (e.g. one that renders tools), set on the tokenizer.
    """

    name: str
    train_dataset: Dataset
    eval_dataset: Dataset
    reward_funcs: list[Callable[..., list]]
    accuracy_reward: str
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[Callable] = field(default_factory=list)
    environment_factory: Any = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        names = [f.__name__ for f in self.reward_funcs]
        if self.accuracy_reward not in names:
            raise ValueError(
                f"Task {self.name!r}: accuracy_reward {self.accuracy_reward!r} is not among its reward "
                f"functions ({', '.join(names)})."
            )

    @property
    def reward_names(self) -> list[str]:
        return [f.__name__ for f in self.reward_funcs]

    def __repr__(self) -> str:
        return (
            f"Task(name={self.name!r}, train={len(self.train_dataset)}, eval={len(self.eval_dataset)}, "
            f"rewards={self.reward_names}, accuracy_reward={self.accuracy_reward!r})"
        )


def user_turn(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def split_holdout(rows: Sequence[dict], n_eval: int, task: str) -> tuple[Dataset, Dataset]:
    """First ``n_eval`` rows held out, the rest for training (rows are already shuffled)."""
    if not isinstance(n_eval, int) or isinstance(n_eval, bool) or n_eval < 0:
        raise ValueError(f"Task {task!r}: n_eval must be a non-negative integer, got {n_eval!r}.")
    if n_eval >= len(rows):
        raise ValueError(
            f"Task {task!r}: n_eval={n_eval} leaves nothing to train on; the task has {len(rows)} rows, "
            f"so n_eval must be below {len(rows)}."
        )
    dataset = Dataset.from_list(list(rows))
    train = dataset.select(range(n_eval, len(rows)))
    held_out = dataset.select(range(n_eval))
    return train, held_out
