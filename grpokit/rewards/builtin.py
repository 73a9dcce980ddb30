"""Built-in reward functions, in TRL's calling convention.

Every reward function is called as::

    f(prompts, completions, completion_ids=None, trainer_state=None, **kwargs) -> list[float | None]

``completions`` holds strings (plain prompts) or message lists such as
``[{"role": "assistant", "content": "..."}]`` (conversational prompts); both are accepted. Dataset
columns other than ``prompt`` arrive as keyword lists aligned with ``completions`` (``answer=[...]``).
``None`` in the result means "no opinion on this sample" (TRL turns it into NaN and skips it).
A function's ``__name__`` names its metrics: ``rewards/<name>/mean``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from .answers import answers_match, extract_answer

__all__ = [
    "FORMAT_REWARD",
    "completion_text",
    "correctness",
    "count_words",
    "format_reward",
    "length",
    "make_length_reward",
    "word_count",
]

#: What ``format`` pays for a well-formed final line; small next to correctness (1.0), so that
#: formatting alone never outweighs a right answer.
FORMAT_REWARD = 0.2

_FINAL_ANSWER_LINE = re.compile(
    r"(?:^|(?<=[^A-Za-z]))Answer:[ \t]*[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\.?\s*$"
)
_WORD = re.compile(r"[^\W_]+(?:['’\-][^\W_]+)*")


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, or the assistant turns of a message list joined.

    Message contents may be strings or lists of parts (``[{"type": "text", "text": ...}]``).
    """
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts: list[str] = []
    for message in completion:
        if not isinstance(message, dict):
            parts.append(str(message))
            continue
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"
            )
    return "\n".join(parts)


def count_words(text: str) -> int:
    """Words are runs of letters or digits; inner apostrophes and hyphens join (``don't``, ``well-known``)."""
    return len(_WORD.findall(text))


def _column(name: str, values: Sequence | None, n: int, func: str) -> Sequence:
    if values is None:
        raise ValueError(
            f"The reward {func!r} needs a dataset column {name!r} (passed to reward functions as the "
            f"keyword {name}=[...]), and none was given."
        )
    if len(values) != n:
        raise ValueError(f"The reward {func!r} got {n} completions but {len(values)} values of {name!r}.")
    return values


def correctness(
    prompts: Sequence | None = None,
    completions: Sequence | None = None,
    completion_ids: Sequence | None = None,
    trainer_state: Any = None,
    *,
    answer: Sequence | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the number after the last ``Answer:`` equals the ``answer`` column, else 0.0.

    Plain numbers are compared exactly; anything else is graded by math-verify (see
    :func:`grpokit.rewards.answers.answers_match`). A reply without ``Answer:`` scores 0.0, and a
    row whose answer is ``None`` scores ``None``.
    """
    completions = list(completions or [])
    answers = _column("answer", answer, len(completions), "correctness")
    out: list[float | None] = []
    for completion, gold in zip(completions, answers, strict=True):
        if gold is None:
            out.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        out.append(1.0 if answers_match(predicted, gold) else 0.0)
    return out


def format_reward(
    prompts: Sequence | None = None,
    completions: Sequence | None = None,
    completion_ids: Sequence | None = None,
    trainer_state: Any = None,
    **kwargs: Any,
) -> list[float | None]:
    """``FORMAT_REWARD`` (0.2) when the reply ends with ``Answer: <number>``, optionally with a full stop.

    ``"11 + 16 = 27. Answer: 27."`` and ``"...\\nAnswer: -3"`` qualify; ``"Answer: 27 apples"``,
    ``"Answer: <number>"`` and text after the answer line do not. ``Answer`` is case-sensitive here.
    """
    return [
        FORMAT_REWARD if _FINAL_ANSWER_LINE.search(completion_text(c).rstrip()) else 0.0
        for c in (completions or [])
    ]


format_reward.__name__ = "format"
format_reward.__qualname__ = "format"


def _closeness(n: int, target: int) -> float:
    """1.0 at the target, falling smoothly and never reaching zero: target / (target + |n - target|)."""
    if target <= 0:
        return 1.0 if n == 0 else 1.0 / (1.0 + n)
    return target / (target + abs(n - target))


def length(
    prompts: Sequence | None = None,
    completions: Sequence | None = None,
    completion_ids: Sequence | None = None,
    trainer_state: Any = None,
    *,
    target_words: Sequence | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """A graded score for hitting the ``target_words`` column: target / (target + |words - target|).

    1.0 at exactly the target; 0.83 one word off a target of 5; 0.1 for 50 words against 5. It never
    reaches zero, so replies that are all too long still differ and give a gradient toward the target.
    Rows whose target is ``None`` score ``None``. For a plain brevity penalty without a target column
    use :func:`make_length_reward`.
    """
    completions = list(completions or [])
    targets = _column("target_words", target_words, len(completions), "length")
    return [
        None if t is None else _closeness(count_words(completion_text(c)), int(t))
        for c, t in zip(completions, targets, strict=True)
    ]


def word_count(
    prompts: Sequence | None = None,
    completions: Sequence | None = None,
    completion_ids: Sequence | None = None,
    trainer_state: Any = None,
    *,
    target_words: Sequence | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when the reply has exactly ``target_words`` words (see :func:`count_words`), else 0.0."""
    completions = list(completions or [])
    targets = _column("target_words", target_words, len(completions), "word_count")
    return [
        None if t is None else float(count_words(completion_text(c)) == int(t))
        for c, t in zip(completions, targets, strict=True)
    ]


def make_length_reward(
    *, max_words: int | None = None, max_tokens: int | None = None, name: str = "brevity"
) -> Callable[..., list[float | None]]:
    """A brevity score without a target column: 1.0 for an empty reply, falling linearly to 0.0 at the limit.

    Give exactly one of ``max_words`` (counted with :func:`count_words`) or ``max_tokens`` (counted
    from ``completion_ids``, which TRL always passes).
    """
    if (max_words is None) == (max_tokens is None):
        raise ValueError(
            f"make_length_reward needs exactly one of max_words or max_tokens; got max_words={max_words!r}, "
            f"max_tokens={max_tokens!r}."
        )
    limit = max_words if max_words is not None else max_tokens
    if limit <= 0:
        raise ValueError(f"make_length_reward: the limit must be positive, got {limit!r}.")

    def reward(prompts=None, completions=None, completion_ids=None, trainer_state=None, **kwargs):
        completions = list(completions or [])
        if max_tokens is not None:
            if completion_ids is None:
                raise ValueError(f"The reward {name!r} counts tokens and needs completion_ids.")
            sizes = [len(ids) for ids in completion_ids]
        else:
            sizes = [count_words(completion_text(c)) for c in completions]
        return [max(0.0, 1.0 - n / limit) for n in sizes]

    reward.__name__ = reward.__qualname__ = name
    return reward
