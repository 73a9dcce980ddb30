"""How grpokit checks user input: one error line naming the field, the value (shortened) and what is allowed.

Every refusal of a user's value is written here: :class:`Checker` checks a config's or a mapping's fields (kinds,
ranges, choices), and :func:`refusal` words any other refusal (a combination of settings, a value the code found
wrong later) the same way: ``"<field>=<value> is not allowed[ <when>]: <what is>"``. ``GRPOConfig``, the job spec of
``grpokit train``, the CLI flags, the scoring services and the tasks all refuse through them (tests/test_codebase.py
keeps the phrase out of every other module).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MAX_VALUE_CHARS = 120
"""A value quoted in an error message is cut to this many characters (a multi-MB value must not flood the log)."""


def short_repr(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters with an ellipsis and the full length."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


def format_range(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    lb = "(-inf" if lo is None else ("(" if lo_open else "[") + f"{lo}"
    ub = "inf)" if hi is None else f"{hi}" + (")" if hi_open else "]")
    return f"{lb}, {ub}"


def refusal(name: str, value: Any, allowed: str, *, when: str = "", error: Callable[[str], Exception] = ValueError,
            prefix: str = "") -> Exception:
    """The error for a refused value: ``"<prefix><name>=<value> is not allowed[ <when>]: <allowed>"``, the value
    shortened (:func:`short_repr`). ``when`` names what makes it wrong (``"with use_vllm=True"``); raise what this
    returns."""
    return error(f"{prefix}{name}={short_repr(value)} is not allowed{' ' + when if when else ''}: {allowed}")


class Checker:
    """Checks the attributes of ``obj`` (a config or a mapping viewed through ``get``) and raises ``error`` with
    ``"<prefix><name>=<value> is not allowed: <what is>"``."""

    def __init__(self, obj: Any, error: Callable[[str], Exception] = ValueError, prefix: str = "",
                 get: Callable[[Any, str], Any] | None = None):
        self.obj = obj
        self.error = error
        self.prefix = prefix
        self.get = get or getattr

    def value(self, name: str) -> Any:
        return self.get(self.obj, name)

    def bad(self, name: str, allowed: str, *, when: str = "") -> Exception:
        """The error for field ``name``'s current value (raise it)."""
        return refusal(name, self.value(name), allowed, when=when, error=self.error, prefix=self.prefix)

    def choice(self, name: str, options) -> None:
        if self.value(name) not in options:
            raise self.bad(name, "use one of " + ", ".join(repr(o) for o in options))

    def boolean(self, name: str, optional: bool = False) -> None:
        v = self.value(name)
        if not (isinstance(v, bool) or (optional and v is None)):
            raise self.bad(name, "expected true or false" + (" (or None)" if optional else ""))

    def number(self, name: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
               hi_open: bool = False, optional: bool = False, integer: bool = False) -> None:
        v = self.value(name)
        if v is None and optional:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
            raise self.bad(name, f"expected {'an integer' if integer else 'a number'}" + (" or None" if optional else ""))
        if isinstance(v, float) and not math.isfinite(v):
            raise self.bad(name, "expected a finite number")
        lo_ok = lo is None or (v > lo if lo_open else v >= lo)
        hi_ok = hi is None or (v < hi if hi_open else v <= hi)
        if not (lo_ok and hi_ok):
            raise self.bad(name, f"must be in {format_range(lo, hi, lo_open, hi_open)}")
