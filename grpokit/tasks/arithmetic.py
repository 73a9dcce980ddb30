"""``arithmetic``: small additions and subtractions, the task of the demo (docs/demo.md)."""

from __future__ import annotations

import random

from ..rewards import correctness, format_reward
from ..validation import refusal
from .base import ANSWER_INSTRUCTION, Task, split_holdout, user_turn

__all__ = ["arithmetic_questions", "make_arithmetic_task"]

MAX_OPERAND = 20

DESCRIPTION = (
    "Add or subtract two whole numbers from 0 to 20 (a + b, and a - b with a > b, so no answer is "
    "negative): 651 distinct questions, shuffled by the seed, the first n_eval held out. The user turn "
    "is \"What is {a} {op} {b}? " + ANSWER_INSTRUCTION + "\" (instruction_first=True: the instruction, then the "
    "question). Rewards: correctness 1.0 when the number "
    "after the last 'Answer:' is right, format 0.2 when the reply ends with 'Answer: <number>'. "
    "SmolLM2-135M-Instruct gets about 2% right greedily before training (docs/demo.md). order='easy_first' "
    "puts the training questions in order of their larger operand (a curriculum; with shuffle_dataset=False)."
)

ORDERS = ("shuffled", "easy_first")


def arithmetic_questions(max_operand: int = MAX_OPERAND) -> list[tuple[int, str, int, int]]:
    """Every question as ``(a, op, b, answer)``, in a fixed order, before shuffling.

    All sums ``a + b`` (a, b in 0..max_operand) and the differences ``a - b`` with ``a > b``: 441 + 210
    = 651 for max_operand 20, the count docs/demo.md gives. (Allowing ``a == b`` would add the
    21 questions ``x - x`` and give 672.)
    """
    questions = [(a, "+", b, a + b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    questions += [(a, "-", b, a - b) for a in range(max_operand + 1) for b in range(a)]
    return questions


def difficulty(question: tuple[int, str, int, int]) -> int:
    """How hard a question is for the curriculum: its larger operand (0..20). What a small model gets wrong is
    mostly sums and differences of numbers above 10 (docs/demo.md)."""
    a, _, b, _ = question
    return max(a, b)


def make_arithmetic_task(*, seed: int = 0, n_eval: int = 128, order: str = "shuffled",
                         instruction_first: bool = False) -> Task:
    """The task; ``order`` only orders the training questions: ``"shuffled"`` (by the seed) or ``"easy_first"`` (a
    curriculum: by :func:`difficulty`, the seed's order within a level). The held-out questions are the same.

    ``instruction_first``: the user turn asks for the answer line first and ends with the question ("End your reply
    with the line 'Answer: <number>'. What is 11 + 16?"). Every prompt then begins with all but its last 11-13
    tokens, which generation and the training forward encode once for all prompts (grpokit.forward.prefix): on SmolLM2's
    chat template 40 of its 51-53 tokens instead of 27."""
    if order not in ORDERS:
        raise refusal("order", order, f"expected one of {', '.join(ORDERS)}", prefix="Task 'arithmetic': ")
    if not isinstance(instruction_first, bool):
        raise refusal("instruction_first", instruction_first, "expected true or false", prefix="Task 'arithmetic': ")
    questions = arithmetic_questions()
    random.Random(seed).shuffle(questions)
    def ask(a: int, op: str, b: int) -> str:
        question = f"What is {a} {op} {b}?"
        return f"{ANSWER_INSTRUCTION} {question}" if instruction_first else f"{question} {ANSWER_INSTRUCTION}"

    rows = [{"prompt": user_turn(ask(a, op, b)), "answer": str(result)} for a, op, b, result in questions]
    train, held_out = split_holdout(rows, n_eval, "arithmetic")
    if order == "easy_first":  # sorted is stable: the seed's order within a level
        train = train.select(sorted(range(len(train)), key=lambda i: difficulty(questions[n_eval + i])))
    return Task(
        name="arithmetic",
        train_dataset=train,
        eval_dataset=held_out,
        reward_funcs=[correctness, format_reward],
        accuracy_reward="correctness",
        description=DESCRIPTION,
        metadata={"seed": seed, "n_eval": n_eval, "n_questions": len(rows), "order": order,
                  "instruction_first": instruction_first},
    )
