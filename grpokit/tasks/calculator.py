"""``calculator``: multiplications too hard to do in the head, with ``multiply`` and ``add`` tools — a multi-turn task
(tool call → tool result → answer) small enough to learn on a CPU (docs/tools.md)."""

from __future__ import annotations

import random

from ..rewards import correctness
from ..tools.templates import CHATML_TOOLS_TEMPLATE
from ..validation import refusal
from .base import Task, split_holdout

__all__ = ["add", "make_calculator_task", "multiply", "subtract"]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return int(a) * int(b)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return int(a) + int(b)


def subtract(a: int, b: int) -> int:
    """Subtract the second integer from the first.

    Args:
        a: the number to subtract from
        b: the number to subtract
    """
    return int(a) - int(b)


TOOLS = {"*": multiply, "+": add, "-": subtract}

DESCRIPTION = (
    "Questions \"What is {a} {op} {b}?\" with a of 3 and b of 2 digits, op among `ops` (default *, + and -), "
    "answered with the multiply, add and subtract tools: the model calls a tool (<tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call>), reads its result, and ends with 'Answer: <number>'. Each prompt starts with "
    "`n_demos` worked exchanges (question, tool call, result, answer) with operators from `demo_ops` (default only "
    "*: which tool fits + and - is for the model to find). Reward: correctness 1.0 when the number after the last "
    "'Answer:' is right. Chat template: grpokit's ChatML with tools."
)


def _question(rng: random.Random, ops: tuple[str, ...]) -> tuple[int, str, int]:
    return rng.randint(100, 999), rng.choice(ops), rng.randint(10, 99)


def _demo(a: int, op: str, b: int) -> list[dict]:
    tool = TOOLS[op]
    call = {"type": "function", "function": {"name": tool.__name__, "arguments": {"a": a, "b": b}}}
    result = tool(a, b)
    return [{"role": "user", "content": f"What is {a} {op} {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": tool.__name__, "content": str(result)},
            {"role": "assistant", "content": f"Answer: {result}"}]


def make_calculator_task(*, seed: int = 0, n_eval: int = 128, n_train: int = 1024, n_demos: int = 2,
                         ops: str = "*+-", demo_ops: str | None = "*") -> Task:
    """``n_train + n_eval`` distinct questions with operators from ``ops``; every prompt has ``n_demos`` worked
    exchanges first (their operators cycling through ``demo_ops``, default ``ops``), then the question."""
    demo_ops = ops if demo_ops is None else demo_ops
    owner = "Task 'calculator': "
    for name, value in (("ops", ops), ("demo_ops", demo_ops)):
        if not isinstance(value, str) or not value or any(op not in TOOLS for op in value) or len(set(value)) != len(value):
            raise refusal(name, value, f"expected operators among {''.join(TOOLS)}, each once", prefix=owner)
    if isinstance(n_demos, bool) or not isinstance(n_demos, int) or n_demos < 0:
        raise refusal("n_demos", n_demos, "expected an integer ≥ 0", prefix=owner)
    if isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < 1:
        raise refusal("n_train", n_train, "expected a positive integer", prefix=owner)
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n_train + n_eval:
        q = _question(rng, tuple(ops))
        if q in seen:
            continue
        seen.add(q)
        demos = [m for k in range(n_demos) for m in _demo(*_question(rng, (demo_ops[k % len(demo_ops)],)))]
        a, op, b = q
        rows.append({"prompt": demos + [{"role": "user", "content": f"What is {a} {op} {b}?"}],
                     "answer": str(TOOLS[op](a, b))})
    train, held_out = split_holdout(rows, n_eval, "calculator")
    return Task(
        name="calculator",
        train_dataset=train,
        eval_dataset=held_out,
        reward_funcs=[correctness],
        accuracy_reward="correctness",
        description=DESCRIPTION,
        metadata={"seed": seed, "n_eval": n_eval, "n_train": n_train, "n_demos": n_demos, "ops": ops,
                  "demo_ops": demo_ops},
        tools=[TOOLS[op] for op in TOOLS if op in ops or op in demo_ops],
        chat_template=CHATML_TOOLS_TEMPLATE,
    )
