"""Tool calls read back from completions in each chat-template format, and run: errors become tool messages."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from grpokit.tools import CHATML_TOOLS_TEMPLATE, detect_style, parse_turn
from grpokit.tools.execution import run_calls, tool_message

TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"


def test_hermes_calls_and_content():
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n' \
           '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>'
    turn = parse_turn(text, "hermes")
    assert turn.content == "Let me add."
    assert [c["function"] for c in turn.calls] == [{"name": "add", "arguments": {"a": 1, "b": 2}},
                                                  {"name": "neg", "arguments": {"x": 3}}]
    assert turn.message()["tool_calls"][0] == {"type": "function", "function": {"name": "add",
                                                                                "arguments": {"a": 1, "b": 2}}}


def test_invalid_and_unfinished_calls():
    bad = parse_turn('<tool_call>{"name": "add", "arguments": {"a": 1,}</tool_call>', "hermes")
    assert len(bad.calls) == 1 and "not valid JSON" in bad.calls[0]["error"]
    not_object = parse_turn('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "hermes")
    assert "not a JSON object" in not_object.calls[0]["error"]
    unfinished = parse_turn('<tool_call>{"name": "add", "argu', "hermes")  # cut by the length limit: text
    assert unfinished.calls == [] and unfinished.content.startswith("<tool_call>")
    assert parse_turn("no calls here", "hermes").calls == []


def test_llama3_and_mistral_formats():
    llama = parse_turn('<|python_tag|>{"name": "add", "parameters": {"a": 4, "b": 5}}', "llama3_json")
    assert llama.calls[0]["function"] == {"name": "add", "arguments": {"a": 4, "b": 5}}
    assert parse_turn("The answer is 9.", "llama3_json").calls == []
    mistral = parse_turn('Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 1}}]', "mistral")
    assert mistral.content == "Sure." and mistral.calls[0]["function"]["name"] == "add"


def test_styles_are_detected_from_the_templates():
    assert detect_style(CHATML_TOOLS_TEMPLATE) == "hermes"
    assert detect_style((TRL_TEMPLATES / "qwen2_5.jinja").read_text()) == "hermes"
    assert detect_style((TRL_TEMPLATES / "llama3_2.jinja").read_text()) == "llama3_json"
    assert detect_style("{{ messages }}") is None


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b


def boom() -> str:
    """Fails.
    """
    raise RuntimeError("kaboom")


async def slow_double(x: int) -> int:
    """Double, asynchronously.

    Args:
        x: the number
    """
    await asyncio.sleep(0)
    return 2 * x


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_results_errors_and_async_tools():
    tools = {"add": add, "boom": boom, "slow_double": slow_double}
    invalid = parse_turn('<tool_call>{"name": "add"</tool_call>', "hermes").calls[0]
    results = run_calls([[call("add", a=2, b=3), call("nope"), call("boom"), call("add", a=1), invalid],
                         [call("slow_double", x=21)]], [tools, tools])
    first, second = results
    assert [(r.name, r.content, r.failed) for r in first[:3]] == [
        ("add", "5", False), ("nope", "{'error': 'Tool nope not found.'}", True),
        ("boom", "{'error': 'kaboom'}", True)]
    assert first[3].failed and "missing 1 required positional argument" in first[3].content
    assert first[4].failed and "not valid JSON" in first[4].content
    assert [(r.name, r.content, r.failed) for r in second] == [("slow_double", "42", False)]
    assert tool_message(first[0]) == {"role": "tool", "name": "add", "content": "5"}


def test_rows_run_concurrently():
    barrier = threading.Barrier(3, timeout=120)  # only passes when the three rows' tools run at the same time

    def meet() -> str:
        """Wait for the others.
        """
        barrier.wait()
        return "met"

    results = run_calls([[call("meet")]] * 3, [{"meet": meet}] * 3)
    assert all(r[0].content == "met" and not r[0].failed for r in results)


@pytest.mark.parametrize("style", ["bogus"])
def test_unknown_style(style):
    with pytest.raises(ValueError, match="tool-call style 'bogus' is not supported"):
        parse_turn("x", style)
