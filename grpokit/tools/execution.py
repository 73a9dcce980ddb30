"""Running the tool calls of a batch of rollouts: each rollout's calls in order, the rollouts concurrently (a thread
per rollout, async tools awaited in it). A tool that raises, an unknown tool name or an invalid call becomes an
error message in the tool turn, counted as a failure, never a crash of the run (messages as TRL writes them)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolResult:
    name: str
    content: Any
    """What goes into the tool message: ``str(result)``, a list of content blocks as returned, or the error."""
    failed: bool


def _run_one(call: dict[str, Any], tools: dict[str, Callable]) -> ToolResult:
    fn_spec = call.get("function", {})
    name = str(fn_spec.get("name", "unknown"))
    if "error" in call:
        return ToolResult(name, str({"error": call["error"]}), True)
    if call.get("type", "function") != "function":
        return ToolResult(name, str({"error": f"Unsupported tool call type: {call.get('type')}"}), True)
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        result = tools[name](**fn_spec.get("arguments", {}))
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to read, not the run's to die of
        return ToolResult(name, str({"error": str(e)}), True)
    return ToolResult(name, result if isinstance(result, list) else str(result), False)


async def _await(awaitable):
    return await awaitable


def run_calls(calls_per_row: list[list[dict[str, Any]]], tools_per_row: list[dict[str, Callable]],
              max_workers: int = 16) -> list[list[ToolResult]]:
    """The results of every row's calls, in call order; rows run concurrently."""
    def row(i: int) -> list[ToolResult]:
        return [_run_one(c, tools_per_row[i]) for c in calls_per_row[i]]

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
