"""``word_problems``: short arithmetic stories with one or two operations and an exact whole answer."""

from __future__ import annotations

import random
from collections.abc import Callable

from ..rewards import correctness, format_reward
from .base import ANSWER_INSTRUCTION, Task, split_holdout, user_turn

__all__ = ["TEMPLATES", "make_word_problems_task", "word_problem"]

NAMES = [
    "Tom", "Anna", "Ben", "Maria", "Sam", "Lucy", "Omar", "Priya", "Leo", "Mia",
    "Jack", "Zoe", "Noah", "Emma", "Ravi", "Sofia", "Kenji", "Amara", "Luis", "Hana",
]  # fmt: skip
ITEMS = [
    "apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells",
    "stamps", "balloons", "oranges", "toy cars", "crayons", "coins", "buttons", "eggs",
]  # fmt: skip

Problem = tuple[str, int]


def _add(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a, b = r.randint(2, 30), r.randint(2, 20)
    return f"{n} has {a} {it} and buys {b} more. How many {it} does {n} have now?", a + b


def _sub(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a = r.randint(5, 40)
    b = r.randint(2, a - 1)
    return f"{n} has {a} {it} and gives {b} of them to {m}. How many {it} does {n} have left?", a - b


def _mul(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a, b = r.randint(2, 9), r.randint(2, 10)
    return f"{n} buys {a} bags of {it}. Each bag holds {b} {it}. How many {it} does {n} buy in all?", a * b


def _div(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a, b = r.randint(2, 9), r.randint(2, 10)
    return f"{n} shares {a * b} {it} equally among {a} friends. How many {it} does each friend get?", b


def _difference(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    b = r.randint(2, 30)
    a = b + r.randint(1, 20)
    return f"{n} has {a} {it} and {m} has {b} {it}. How many more {it} does {n} have than {m}?", a - b


def _add_sub(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a, b = r.randint(2, 30), r.randint(2, 20)
    c = r.randint(1, a + b - 1)
    return (
        f"{n} has {a} {it}, finds {b} more, and then loses {c}. How many {it} does {n} have now?",
        a + b - c,
    )


def _together(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a, b = r.randint(2, 25), r.randint(2, 15)
    return (
        f"{n} has {a} {it}. {m} has {b} more {it} than {n}. How many {it} do {n} and {m} have together?",
        a + (a + b),
    )


def _mul_add(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a, b, c = r.randint(2, 6), r.randint(2, 10), r.randint(1, 20)
    return (
        f"{n} has {c} {it}. Then {n} buys {a} packs with {b} {it} in each pack. How many {it} does {n} have now?",
        c + a * b,
    )


def _mul_sub(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a, b = r.randint(2, 6), r.randint(2, 10)
    c = r.randint(1, a * b - 1)
    return (
        f"{n} buys {a} boxes of {it} with {b} {it} in each box and gives away {c}. "
        f"How many {it} does {n} have left?",
        a * b - c,
    )


def _sub_sub(r: random.Random, n: str, m: str, k: str, it: str) -> Problem:
    a = r.randint(10, 40)
    b = r.randint(1, a // 2)
    c = r.randint(1, a - b - 1)
    return (
        f"{n} has {a} {it}. {n} gives {b} to {m} and {c} to {k}. How many {it} does {n} have left?",
        a - b - c,
    )


#: Question templates: each draws its numbers from the generator and returns (question, answer).
TEMPLATES: list[Callable[..., Problem]] = [
    _add, _sub, _mul, _div, _difference, _add_sub, _together, _mul_add, _mul_sub, _sub_sub,
]  # fmt: skip

DESCRIPTION = (
    "Arithmetic word problems from 10 templates (\"Tom has 7 apples and buys 5 more...\"): one or two "
    "operations among +, -, x, / on small whole numbers, every answer a whole number >= 0. Generated "
    "from the seed, distinct question texts, the first n_eval held out. The user turn ends with \""
    + ANSWER_INSTRUCTION
    + "\". Rewards: correctness 1.0 (graded exactly, math-verify for non-plain answers) and format 0.2."
)


def word_problem(rng: random.Random) -> Problem:
    """One random problem: ``(question, answer)``."""
    template = rng.choice(TEMPLATES)
    n, m, k = rng.sample(NAMES, 3)
    return template(rng, n, m, k, rng.choice(ITEMS))


def make_word_problems_task(*, seed: int = 0, n_eval: int = 128, n_train: int = 1000) -> Task:
    if not isinstance(n_train, int) or n_train < 1:
        raise ValueError(f"Task 'word_problems': n_train must be a positive integer, got {n_train!r}.")
    rng = random.Random(seed)
    wanted = n_eval + n_train
    seen: set[str] = set()
    rows: list[dict] = []
    attempts = 0
    while len(rows) < wanted:
        attempts += 1
        if attempts > 50 * wanted:  # the templates allow millions of questions; this never triggers
            raise RuntimeError(f"word_problems: could not draw {wanted} distinct questions.")
        question, answer = word_problem(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": user_turn(f"{question} {ANSWER_INSTRUCTION}"), "answer": str(answer)})
    train, held_out = split_holdout(rows, n_eval, "word_problems")
    return Task(
        name="word_problems",
        train_dataset=train,
        eval_dataset=held_out,
        reward_funcs=[correctness, format_reward],
        accuracy_reward="correctness",
        description=DESCRIPTION,
        metadata={"seed": seed, "n_eval": n_eval, "n_train": n_train},
    )
