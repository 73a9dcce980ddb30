"""Reading and grading final answers: ``Answer: <number>`` lines, GSM8K ``#### 42`` answers.

Grading is exact and fast for plain numbers (``27``, ``-3``, ``1,234``, ``27.5``, ``3/4``): they are
compared as exact fractions, no sympy involved (a few microseconds). Anything else (``$27$``,
``\\frac{1}{2}``, ``27 apples``, ``\\boxed{12}``) falls back to math-verify, called with its
signal-based timeouts switched off so that it works from any thread; the text handed to it is
first cut to one short line and refused if it holds exponents or factorials, the constructs that
can make sympy run for minutes (``9^9^9^9``). Model output is only ever parsed here, never executed.
"""

from __future__ import annotations

import functools
import logging
import re
from fractions import Fraction

__all__ = [
    "ANSWER_PATTERN",
    "answers_match",
    "extract_answer",
    "extract_gsm8k_answer",
    "parse_number",
]

#: The marker whose last occurrence introduces the final answer.
ANSWER_PATTERN = re.compile(r"answer\s*:", re.IGNORECASE)

_NUMBER = r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_PLAIN_NUMBER = re.compile(rf"(?P<num>{_NUMBER})(?:\s*/\s*(?P<den>{_NUMBER}))?")
_WRAPPERS = "*_`$ \t"
_MAX_FALLBACK_CHARS = 64
_UNSAFE_FOR_SYMPY = re.compile(r"[\^!]|\*\*|\\(?:exp|sum|prod|int|lim|binom|choose)|[0-9]\s*[eE]\s*[-+]?[0-9]{3,}")
_GSM8K_MARKER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
# Two numbers joined by an operator: an expression left for the grader to compute ("14 - 12", "3 \\times 4").
_UNEVALUATED = re.compile(r"\d\s*(?:[-+*/×÷]|\\times|\\cdot|\\div)\s*[-(]?\s*\d")


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns once that timeouts are off; they are off on purpose (see module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader", "math_verify"):
    logging.getLogger(_name).addFilter(_DropTimeoutWarning())


def parse_number(text: str | int | float | None) -> Fraction | None:
    """Read ``text`` as one plain number and nothing else, exactly; ``None`` if it is not one.

    Accepts an optional sign, thousands separators (``1,234``), decimals, a fraction ``a/b``,
    surrounding markdown or ``$`` and a trailing full stop: ``"27."``, ``"**27**"``, ``"$-3$"``.
    """
    if text is None:
        return None
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return Fraction(text)
    if isinstance(text, float):
        return Fraction(text).limit_denominator(10**9) if text == text and abs(text) != float("inf") else None
    s = str(text).strip().strip(_WRAPPERS)
    if s.endswith("."):
        s = s[:-1].rstrip(_WRAPPERS)
    m = _PLAIN_NUMBER.fullmatch(s)
    if m is None:
        return None
    try:
        value = Fraction(m.group("num").replace(",", "").replace("−", "-"))
        if m.group("den") is not None:
            den = Fraction(m.group("den").replace(",", "").replace("−", "-"))
            if den == 0:
                return None
            value /= den
    except (ValueError, ZeroDivisionError):
        return None
    return value


_ANY_NUMBER = re.compile(r"[-−]?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def last_number(text: str) -> Fraction | None:
    """The last number anywhere in ``text`` (``"11 + 20 = 31"`` -> 31), whatever the format around it; ``None`` when
    it holds none. What a format-free accuracy compares with the answer."""
    if not isinstance(text, str):
        return None
    found = _ANY_NUMBER.findall(text)
    return parse_number(found[-1].rstrip(",")) if found else None


def extract_answer(text: str) -> str | None:
    """The text after the last ``Answer:`` (any case), up to the end of its line; ``None`` if absent."""
    if not isinstance(text, str):
        return None
    matches = list(ANSWER_PATTERN.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    rest = text[last.end():].lstrip(" \t*_")
    line = rest.split("\n", 1)[0].strip()
    return line or None


def extract_gsm8k_answer(answer: str | int | float | None) -> str | None:
    """GSM8K-style gold answers: the text after ``####`` with thousands separators dropped.

    ``"... so 40 + 2 = 42.\\n#### 42"`` -> ``"42"``; ``"#### 1,234"`` -> ``"1234"``. Anything without a
    ``####`` is returned stripped, numbers as their shortest string (``42.0`` -> ``"42"``).
    """
    if answer is None:
        return None
    if isinstance(answer, float):
        if answer != answer:  # NaN: a missing value in a CSV column
            return None
        return str(int(answer)) if answer.is_integer() else repr(answer)
    if not isinstance(answer, str):
        return str(answer)
    m = _GSM8K_MARKER.search(answer)
    text = m.group(1) if m else answer.strip()
    if parse_number(text) is not None:
        text = text.strip().rstrip(".").replace(",", "")
    return text


@functools.lru_cache(maxsize=4096)
def _mv_parse(text: str):
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def _mv_verify(gold: str, pred: str) -> bool:
    from math_verify import verify

    gold_parsed = _mv_parse(gold)
    pred_parsed = _mv_parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    try:
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:  # math-verify's own errors must never stop training
        return False


def _safe_for_math_verify(text: str) -> bool:
    return len(text) <= _MAX_FALLBACK_CHARS and not _UNSAFE_FOR_SYMPY.search(text)


def answers_match(predicted: str | None, gold: str | int | float | None) -> bool:
    """Whether a predicted final answer equals the gold answer.

    Plain numbers on both sides are compared exactly (``"27."`` equals ``27``; ``"27.5"`` does not;
    ``"0.5"`` equals ``"1/2"``). Otherwise math-verify decides (``"$\\frac{1}{2}$"`` equals ``"0.5"``),
    on the short, exponent-free text only; longer or riskier text counts as wrong. When the gold answer is a
    number, a prediction that is an unevaluated expression (``"14 - 12"``, ``"3 \\times 4"``) is wrong: the
    grader must not do the arithmetic it asked for (a policy learned exactly that, echoing the question).
    """
    if predicted is None or gold is None:
        return False
    pred_num = parse_number(predicted)
    gold_num = parse_number(gold)
    if pred_num is not None and gold_num is not None:
        return pred_num == gold_num
    predicted = str(predicted).strip()
    gold_text = str(gold).strip()
    if not predicted or not gold_text:
        return False
    if not _safe_for_math_verify(predicted) or not _safe_for_math_verify(gold_text):
        return False
    if gold_num is not None and _UNEVALUATED.search(predicted):
        return False  # a numeric answer written as a sum or product: the grader would do the arithmetic
    # math-verify looks for LaTeX or a plain expression; a bare "27 apples" parses as 27.
    return _mv_verify(gold_text, predicted)
