"""Small shared helpers: JSON sanitising, atomic writes, metrics.jsonl reading, formatting."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

METRICS_FILENAME = "metrics.jsonl"
#: metrics.jsonl keys of a held-out evaluation during training: accuracy and its 95% interval
HELD_OUT_KEYS = ("heldout/accuracy", "heldout/accuracy_ci_low", "heldout/accuracy_ci_high")


def to_float(value: Any) -> float | None:
    """Return ``value`` as a Python float if it is a real number (incl. numpy/torch scalars), else None.

    Booleans count as numbers (0/1). Non-finite values are returned as is (NaN/inf floats).
    """
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            numel = getattr(value, "numel", None)
            size = numel() if callable(numel) else getattr(value, "size", 1)
            if size != 1:
                return None
            v = item()
        except Exception:  # noqa: BLE001 - anything odd is simply "not a number"
            return None
        if isinstance(v, (bool, int, float)):
            return float(v)
    return None


def finite_or_none(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return value


def jsonable(obj: Any) -> Any:
    """Recursively convert ``obj`` into something ``json.dumps(..., allow_nan=False)`` accepts.

    NaN/inf become None; Paths, enums and unknown objects become strings; dataclasses become dicts;
    numpy/torch scalars become Python numbers.
    """
    if obj is None or isinstance(obj, (str, bool)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    f = to_float(obj)
    if f is not None:
        if float(f).is_integer() and "int" in type(obj).__name__.lower():
            return int(f)
        return finite_or_none(f)
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        try:
            return jsonable(tolist())
        except Exception:  # noqa: BLE001
            pass
    return str(obj)


def _iter_json_lines(path: Path) -> Iterable[dict]:
    try:
        fh = open(path, encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        return
    with fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # e.g. a half-written last line after a crash
            if isinstance(rec, dict):
                yield rec


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read a metrics.jsonl file into one merged record per optimizer step, sorted by step.

    * Lines logged at the same step (train metrics, eval metrics, the end-of-training summary) are
      merged into one dict; a later value for the same key wins.
    * Resumes/restarts: a line carrying ``"resumed_from": S`` (written by MetricsJsonlCallback) drops
      every earlier record with step > S; without the marker, a line whose step is lower than the
      previous line's also starts a new timeline (records at or after its step are dropped).
    * Unparseable lines and lines without an integer ``step`` are skipped. ``null`` values are kept
      as None (they were NaN/inf when logged).
    """
    by_step: dict[int, dict] = {}
    last_step: int | None = None
    for rec in _iter_json_lines(Path(path)):
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            continue
        step = int(step)
        resumed_from = rec.pop("resumed_from", None)
        if isinstance(resumed_from, (int, float)) and not isinstance(resumed_from, bool):
            for s in [s for s in by_step if s > resumed_from]:
                del by_step[s]
        elif last_step is not None and step < last_step:
            for s in [s for s in by_step if s >= step]:
                del by_step[s]
        by_step.setdefault(step, {}).update(rec)
        by_step[step]["step"] = step
        last_step = step
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) for the records where ``key`` holds a finite number."""
    xs, ys = [], []
    for rec in records:
        v = rec.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        xs.append(rec["step"])
        ys.append(float(v))
    return xs, ys


def fmt_duration(seconds: float | None) -> str:
    """``8m12s``, ``1h02m``, ``45s``, ``2.3s``; ``?`` for None/non-finite/negative."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def as_text(x: Any) -> str:
    """Render a prompt/completion as plain text: strings as is, chat messages as their contents."""
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        content = x.get("content", x)
        if isinstance(content, list):  # multimodal content parts
            return " ".join(as_text(p.get("text", "") if isinstance(p, dict) else p) for p in content)
        return as_text(content) if content is not x else str(x)
    if isinstance(x, (list, tuple)):
        if x and all(isinstance(m, dict) and "content" in m for m in x):
            # conversational: show the last user turn for prompts, all assistant text otherwise
            users = [m for m in x if m.get("role") == "user"]
            if users and x[-1].get("role") != "assistant":
                return as_text(users[-1])
            return "\n".join(as_text(m) for m in x)
        return " ".join(as_text(m) for m in x)
    return str(x)


def truncate(text: str, limit: int) -> str:
    if limit is not None and len(text) > limit:
        return text[: max(0, limit - 1)].rstrip() + "…"
    return text
