"""Reading a judge's reply as a score: a number in a range, a label from a map, or a field of a JSON object.

Pure functions of the reply's text; ``None`` means the reply could not be read (the judge counts it as a parse
failure and the row gets ``None``). The rules, in order:

* ``json_field`` set: the reply's JSON object is the whole reply, else the last fenced ```json block, else the
  first ``{...}`` in the text that parses. Its field ``json_field`` is then read as below (a string value goes
  through ``labels`` when given, else must be a number written as text; a boolean is unreadable).
* ``labels`` set (and no ``json_field``): the label whose last whole-word occurrence (any case) ends last in the
  reply wins, the longer label when two end together (``"Not correct. Verdict: correct"`` reads ``correct``;
  ``"Verdict: not correct"`` with labels ``correct`` and ``not correct`` reads ``not correct``); its value is the
  score as given (labels are never normalised).
* otherwise a number: the first match of ``pattern`` (a regex whose first group is the number), or without a
  pattern the first number in the reply (``"7/10"`` reads 7). It must lie in ``score_range``, else it is unreadable;
  with ``normalize`` the score is ``(x - lo) / (hi - lo)``, in [0, 1], else ``x`` itself.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from ..validation import Checker

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_FENCED_JSON = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL | re.IGNORECASE)
MAX_REPLY_CHARS = 100_000
"""Replies are read up to this many characters (a runaway judge must not cost seconds of regex time)."""


@dataclass(frozen=True)
class ScoreRule:
    """How a reply becomes a score (see the module docstring)."""

    score_range: tuple[float, float] = (0.0, 10.0)
    normalize: bool = True
    labels: dict[str, float] | None = None
    json_field: str | None = None
    pattern: str | None = None

    def check(self, owner: str) -> ScoreRule:
        """Itself, checked; one error line per wrong value."""
        check = Checker(self, prefix=f"{owner}.")
        r = self.score_range
        if (not isinstance(r, (list, tuple)) or len(r) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in r)
                or not r[0] < r[1]):
            raise check.bad("score_range", "expected [low, high] with low < high")
        check.boolean("normalize")
        if self.labels is not None:
            ok = isinstance(self.labels, dict) and self.labels and all(
                isinstance(k, str) and k.strip() and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) for k, v in self.labels.items())
            if not ok:
                raise check.bad("labels", "expected a mapping of label text to a finite number, e.g. "
                                "{yes: 1.0, no: 0.0}")
        if self.json_field is not None and (not isinstance(self.json_field, str) or not self.json_field):
            raise check.bad("json_field", "expected a field name")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except (re.error, TypeError) as e:
                raise check.bad("pattern", f"not a regular expression ({e})") from None
            if groups < 1:
                raise check.bad("pattern", "it needs a group around the number, e.g. 'Score: (\\d+)'")
        return ScoreRule(tuple(float(x) for x in r), self.normalize, self.labels, self.json_field, self.pattern)


def parse_score(reply: str | None, rule: ScoreRule) -> float | None:
    """The score ``reply`` gives under ``rule``, or ``None`` when it cannot be read."""
    if not isinstance(reply, str) or not reply.strip():
        return None
    reply = reply[:MAX_REPLY_CHARS]
    if rule.json_field is not None:
        obj = find_json_object(reply)
        if obj is None or rule.json_field not in obj:
            return None
        return _value(obj[rule.json_field], rule)
    if rule.labels is not None:
        return label_score(reply, rule.labels)
    return _number(_first_number(reply, rule.pattern), rule)


def _value(value: Any, rule: ScoreRule) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return _number(float(value), rule)
    if isinstance(value, str):
        if rule.labels is not None:
            return label_score(value, rule.labels)
        return _number(_first_number(value.strip(), None) if _NUMBER.fullmatch(value.strip()) else None, rule)
    return None


def _number(x: float | None, rule: ScoreRule) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    lo, hi = rule.score_range
    if not lo <= x <= hi:
        return None
    return (x - lo) / (hi - lo) if rule.normalize else x


def _first_number(text: str, pattern: str | None) -> float | None:
    if pattern is not None:
        m = re.search(pattern, text)
        if m is None or m.group(1) is None:
            return None
        text = m.group(1)
        m = _NUMBER.fullmatch(text.strip())
    else:
        m = _NUMBER.search(text)
    if m is None:
        return None
    try:
        return float(m.group(0))
    except ValueError:
        return None


def label_score(text: str, labels: dict[str, float]) -> float | None:
    """The value of the label whose last whole-word occurrence (any case) ends last in ``text``, the longer label when
    two end together (``"not correct"`` over ``"correct"``); None if no label occurs."""
    best, best_end = None, -1
    for label, value in labels.items():
        pattern = r"(?<!\w)" + re.escape(label.strip()) + r"(?!\w)"
        for m in re.finditer(pattern, text, re.IGNORECASE):
            if m.end() > best_end or (m.end() == best_end and len(label.strip()) > len(best[0])):
                best, best_end = (label.strip(), float(value)), m.end()
    return None if best is None else best[1]


def find_json_object(text: str) -> dict | None:
    """The reply's JSON object: the whole text, else the last fenced ```json block, else the first ``{...}`` that
    parses; None if there is none."""
    for candidate in [text.strip()] + [m.strip() for m in reversed(_FENCED_JSON.findall(text))]:
        try:
            obj = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    decoder = json.JSONDecoder()
    start, tries = text.find("{"), 0
    while start != -1 and tries < 100:
        tries += 1
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return obj
        start = text.find("{", start + 1)
    return None
