"""Tool calls in a completion, in the formats chat templates ask models to write them:

- ``hermes`` (Qwen2.5/Qwen3, Hermes, grpokit's ChatML template): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1/3.2): the whole reply is ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A call is ``{"type": "function", "function": {"name": str, "arguments": dict}}``. A call whose body is complete but
not a valid call (bad JSON, no name, arguments that are not an object) is kept as an *invalid* call: the tool loop
answers it with an error message and counts it as a failure. An unfinished block (cut by the length limit) is
plain text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

STYLES = ("hermes", "llama3_json", "mistral")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class ParsedTurn:
    content: str
    """The reply's text outside its tool calls."""
    calls: list[dict[str, Any]] = field(default_factory=list)
    """Valid calls, in order, and invalid ones as ``{"type": "function", "function": {"name": ...}, "error": why}``."""

    def message(self) -> dict[str, Any]:
        """The assistant message of this turn, as chat templates take it."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            msg["tool_calls"] = [{"type": "function", "function": dict(c["function"])} for c in self.calls]
        return msg


def detect_style(chat_template: str | None) -> str | None:
    """The tool-call format a chat template asks for, from the markers it renders; None when it renders none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "ipython" in chat_template and "parameters" in chat_template:
        return "llama3_json"
    return None


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        return {"type": "function", "function": {"name": str(name)}, "error": "the tool call has no name"}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return {"type": "function", "function": {"name": name},
                "error": f"the arguments of {name} are not a JSON object: {json.dumps(arguments)[:200]}"}
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _from_json(body: str, args_key: str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return {"type": "function", "function": {"name": "unknown"}, "error": f"the tool call is not valid JSON ({e})"}
    if not isinstance(obj, dict):
        return {"type": "function", "function": {"name": "unknown"}, "error": "the tool call is not a JSON object"}
    return _call(obj.get("name"), obj.get(args_key, obj.get("arguments")))


def parse_turn(text: str, style: str) -> ParsedTurn:
    """The content and tool calls of one assistant reply written in ``style``."""
    if style == "hermes":
        calls = [_from_json(m.group(1).strip(), "arguments") for m in _HERMES.finditer(text)]
        return ParsedTurn(content=_HERMES.sub("", text).strip(), calls=calls)
    if style == "llama3_json":
        body = text.replace("<|python_tag|>", "").strip()
        if not body.startswith("{"):
            return ParsedTurn(content=text.strip())
        return ParsedTurn(content="", calls=[_from_json(body, "parameters")])
    if style == "mistral":
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return ParsedTurn(content=text.strip())
        try:
            items = json.loads(rest.strip())
        except json.JSONDecodeError as e:
            return ParsedTurn(content=head.strip(), calls=[{"type": "function", "function": {"name": "unknown"},
                                                            "error": f"the tool calls are not valid JSON ({e})"}])
        items = items if isinstance(items, list) else [items]
        calls = [_call(i.get("name"), i.get("arguments")) if isinstance(i, dict) else
                 {"type": "function", "function": {"name": "unknown"}, "error": "a tool call is not a JSON object"}
                 for i in items]
        return ParsedTurn(content=head.strip(), calls=calls)
    raise ValueError(f"tool-call style {style!r} is not supported; allowed: {', '.join(STYLES)}")
