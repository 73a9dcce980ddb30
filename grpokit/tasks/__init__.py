"""Built-in tasks with verifiable answers, and tasks from local files.

>>> from grpokit.tasks import get_task
>>> task = get_task("arithmetic", seed=0)
>>> len(task.train_dataset), len(task.eval_dataset)
(523, 128)

Built-ins (see :func:`list_tasks`):

* ``arithmetic``: ``What is 11 + 16?`` for a, b in 0..20, the demo task (docs/demo.md).
* ``word_problems``: one- and two-step arithmetic stories generated from the seed.
* ``word_count``: "Describe {topic} in one sentence of exactly {n} words." (alias ``format``).
* ``calculator``: "What is 514 * 48?" answered by calling ``multiply``/``add`` tools (multi-turn).
* ``coding``: "Write a Python function ..." graded by running the reply's code against tests in a sandbox.
* ``shapes``: "How many circles are in the picture?" about pictures grpokit draws (vision-language models).

Any ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file works as ``get_task("file:PATH")`` or just
``get_task(PATH)``; see :func:`load_dataset_file`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .arithmetic import arithmetic_questions, make_arithmetic_task
from .base import ANSWER_INSTRUCTION, Task
from .calculator import make_calculator_task
from .coding import make_coding_task
from .files import is_dataset_file, load_dataset_file, make_file_task
from .shapes import make_shapes_task
from .word_count import make_word_count_task
from .word_problems import make_word_problems_task

__all__ = [
    "ANSWER_INSTRUCTION",
    "TASKS",
    "Task",
    "arithmetic_questions",
    "get_task",
    "list_tasks",
    "load_dataset_file",
]

#: Built-in task builders by name; each takes ``seed``, ``n_eval`` and its own keyword options.
TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": make_arithmetic_task,
    "word_problems": make_word_problems_task,
    "word_count": make_word_count_task,
    "calculator": make_calculator_task,
    "coding": make_coding_task,
    "shapes": make_shapes_task,
}
_ALIASES = {"format": "word_count", "word-problems": "word_problems", "word-count": "word_count"}


def list_tasks() -> list[str]:
    """Names of the built-in tasks (files are used as ``"file:PATH"``)."""
    return sorted(TASKS)


def get_task(name: str | os.PathLike, *, seed: int = 0, n_eval: int = 128, **kwargs) -> Task:
    """Build a task: a built-in by name, or a local data file as ``"file:PATH"`` or a plain path.

    Args:
        name: ``"arithmetic"``, ``"word_problems"``, ``"word_count"`` (alias ``"format"``),
            ``"file:data.jsonl"``, or a path to an existing ``.jsonl/.json/.csv/.parquet`` file.
        seed: shuffles (and, for generated tasks, draws) the questions; the same seed gives the same task.
        n_eval: how many questions to hold out for evaluation, disjoint from training.
        **kwargs: task options, e.g. ``n_train`` for ``word_problems``; ``eval_file``,
            ``prompt_column``, ``answer_column``, ``system_prompt``, ``instruction`` for files.
    """
    text = os.fspath(name)
    if text.startswith("file:"):
        return make_file_task(text[len("file:"):], seed=seed, n_eval=n_eval, **kwargs)
    key = _ALIASES.get(text.strip().lower(), text.strip().lower())
    if key in TASKS:
        try:
            return TASKS[key](seed=seed, n_eval=n_eval, **kwargs)
        except TypeError as error:
            if "unexpected keyword" in str(error):
                raise ValueError(f"Task {key!r}: {error}.") from error
            raise
    if is_dataset_file(text) and Path(text).expanduser().is_file():
        return make_file_task(text, seed=seed, n_eval=n_eval, **kwargs)
    hint = ""
    if is_dataset_file(text):
        hint = f" (it looks like a data file, but {text!r} does not exist)"
    raise ValueError(
        f"Unknown task {text!r}{hint}. Built-in tasks: {', '.join(list_tasks())} (alias: format -> word_count); "
        f"or a local file as 'file:PATH' (.jsonl, .json, .csv, .parquet)."
    )
