"""Running the tool calls of a batch of rollouts: each rollout's calls in order, the rollouts concurrently (a thread
per rollout, async tools awaited in it). A tool that raises, an unknown tool name or an invalid call becomes an
error message in the tool turn, counted as a failure, never a crash of the run (messages as TRL writes them).

Each call is bounded by ``timeout_s`` (``tool_timeout_s``, :mod:`grpokit.bounds.user_calls`): past it the model gets an
error message saying so, the call is counted as a failure and a timeout, and it is abandoned. A result longer than
``max_chars`` characters (``max_tool_result_chars``) is cut with a marker saying how long it was. An image in a
result is replaced by a marker (:func:`without_images`): tool results reach the model as text."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..bounds.user_calls import CallTimeout, call
from ..bounds.watchdog import stage
from ..vision.messages import holds_image

logger = logging.getLogger("grpokit")


@dataclass
class ToolResult:
    name: str
    content: Any
    """What goes into the tool message: ``str(result)``, a list of content blocks as returned, or the error."""
    failed: bool
    timed_out: bool = False
    """The call passed its bound (``failed`` too)."""
    cut: int = 0
    """How many texts of the result were cut to ``max_chars``."""
    images: int = 0
    """How many images the result carried (each replaced by :data:`IMAGE_MARKER`)."""


IMAGE_MARKER = "[an image: not shown; grpokit gives the model tool results and observations as text]"
"""What the model reads in place of an image a tool or an environment returned."""

_told_about_images: set[str] = set()


def without_images(content: Any, who: str) -> tuple[Any, int]:
    """A tool result or observation that carries images, as text: its texts, with every image (a PIL image, an image
    content part) replaced by :data:`IMAGE_MARKER`; and how many images there were (content without one: as it is,
    0). grpokit passes tool results and observations to the model as text
    (TRL 1.16 passes a vision-language model the images of a tool's result; grpokit does not yet): the first time
    ``who`` returns one, one warning says so and what to do, instead of a crash or a silent drop."""
    if not holds_image(content):
        return content, 0
    parts = content if isinstance(content, (list, tuple)) else [content]
    texts, n = [], 0
    for part in parts:
        if holds_image(part):
            texts.append(IMAGE_MARKER)
            n += 1
        else:
            texts.append(part["text"] if isinstance(part, dict) and isinstance(part.get("text"), str) else str(part))
    if who not in _told_about_images:
        _told_about_images.add(who)
        logger.warning("grpokit: %s returned an image; grpokit gives the model tool results and observations as text "
                       "(images from tools and environments are not supported yet), so the model reads %r in its "
                       "place (counted in tools/images_dropped_total). Return text: a description, or a name the "
                       "model can refer to; a prompt's own images go in the dataset's image column", who, IMAGE_MARKER)
    return "\n".join(texts), n


def truncate_result(content: Any, max_chars: int | None) -> tuple[Any, int]:
    """A tool result or observation (text, or a list of content blocks) with every text longer than ``max_chars``
    cut and marked; and how many texts were cut."""
    if max_chars is None or content is None:
        return content, 0
    if isinstance(content, list):
        blocks, n = [], 0
        for b in content:
            if isinstance(b, dict) and isinstance(b.get("text"), str):
                text, k = truncate_result(b["text"], max_chars)
                b, n = dict(b, text=text), n + k
            blocks.append(b)
        return blocks, n
    text = content if isinstance(content, str) else str(content)
    if len(text) <= max_chars:
        return content, 0
    return f"{text[:max_chars]}\n[... cut by grpokit: {len(text):,} characters, the first {max_chars:,} shown]", 1


def _run_one(tool_call: dict[str, Any], tools: dict[str, Callable], timeout_s: float | None = None,
             max_chars: int | None = None, row: int | None = None, environment: Any = None) -> ToolResult:
    fn_spec = tool_call.get("function", {})
    name = str(fn_spec.get("name", "unknown"))
    if "error" in tool_call:
        return ToolResult(name, str({"error": tool_call["error"]}), True)
    if tool_call.get("type", "function") != "function":
        return ToolResult(name, str({"error": f"Unsupported tool call type: {tool_call.get('type')}"}), True)
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        fn = tools[name]
        owner = environment if environment is not None and getattr(fn, "__self__", None) is environment else None
        with stage("tool", function=repr(name), row=row):
            result = call(functools.partial(fn, **fn_spec.get("arguments", {})), timeout_s=timeout_s,
                          what=f"tool {name!r}", owner=owner)
    except CallTimeout as e:
        logger.warning("grpokit: %s%s; the model gets an error message instead", e,
                       f" (row {row})" if row is not None else "")
        return ToolResult(name, str({"error": str(e)}), True, timed_out=True)
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to read, not the run's to die of
        return ToolResult(name, str({"error": str(e)}), True)
    result, images = without_images(result, f"tool {name!r}")
    content, cut = truncate_result(result if isinstance(result, list) else str(result), max_chars)
    return ToolResult(name, content, False, cut=cut, images=images)


def run_calls(calls_per_row: list[list[dict[str, Any]]], tools_per_row: list[dict[str, Callable]],
              max_workers: int = 16, timeout_s: float | None = None, max_chars: int | None = None,
              rows: list[int] | None = None, environments: list | None = None) -> list[list[ToolResult]]:
    """The results of every row's calls, in call order; rows run concurrently. ``rows``: each row's index in the
    batch, for messages; ``environments``: each row's environment instance, whose methods are never called while
    an abandoned call on it still runs."""
    def row(i: int) -> list[ToolResult]:
        env = environments[i] if environments else None
        return [_run_one(c, tools_per_row[i], timeout_s, max_chars, rows[i] if rows else i, env)
                for c in calls_per_row[i]]

    busy = [i for i, calls in enumerate(calls_per_row) if calls]
    results: list[list[ToolResult]] = [[] for _ in calls_per_row]
    if len(busy) == 1:
        results[busy[0]] = row(busy[0])
    elif busy:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(busy))) as pool:
            for i, out in zip(busy, pool.map(row, busy)):
                results[i] = out
    return results


def tool_message(result: ToolResult) -> dict[str, Any]:
    return {"role": "tool", "name": result.name, "content": result.content}
