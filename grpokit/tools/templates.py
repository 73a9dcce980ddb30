"""Chat templates and tool calls: whether a template can render a tool conversation, the tokens a tool turn adds
after an assistant turn (so history is never re-tokenised), and grpokit's own tool-capable ChatML template for
models whose template has no tools (SmolLM2's, for example)."""

from __future__ import annotations

from typing import Any

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You can call these tools. Tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a tool, reply with <tool_call>{\"name\": <tool name>, \"arguments\": <JSON object>}"
    "</tool_call> and nothing else. The result comes back in <tool_response></tool_response>.<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message['content'] | string) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A ChatML template that renders tools (a JSON schema per line in the system turn), tool calls in the hermes format
(``<tool_call>{...}</tool_call>``) and tool results as ``<tool_response>`` blocks in a user turn. For ChatML models
whose own template ignores tools: ``tokenizer.chat_template = CHATML_TOOLS_TEMPLATE``."""

_PROBE_NAME, _PROBE_ARG, _PROBE_VALUE, _PROBE_RESULT = "probe_tool_x7", "probe_arg_q3", "probe_value_k9", "probe_result_z4"


def _probe_conversation() -> list[dict[str, Any]]:
    call = {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {_PROBE_ARG: _PROBE_VALUE}}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": _PROBE_NAME, "content": _PROBE_RESULT}]


def text_renderer(processing_class) -> tuple[Any, dict[str, Any]]:
    """What renders text-only chat turns (tool calls and results): a tokenizer, or a vision-language model's
    processor's tokenizer with the processor's chat template (``(tokenizer, extra apply_chat_template kwargs)``)."""
    tokenizer = getattr(processing_class, "tokenizer", None)
    if tokenizer is None:
        return processing_class, {}
    template = getattr(processing_class, "chat_template", None)
    return tokenizer, ({"chat_template": template} if template else {})


def supports_tool_calls(tokenizer, chat_template_kwargs: dict | None = None) -> bool:
    """Whether the tokenizer's chat template (a processor's: :func:`text_renderer`) renders a user → assistant tool
    call → tool result conversation with the call's name, argument and value and the result all in the text."""
    tokenizer, extra = text_renderer(tokenizer)
    try:
        text = tokenizer.apply_chat_template(_probe_conversation(), tokenize=False,
                                             **{**extra, **(chat_template_kwargs or {})})
    except Exception:  # noqa: BLE001 - a template that cannot render it does not support it
        return False
    return all(s in text for s in (_PROBE_NAME, _PROBE_ARG, _PROBE_VALUE, _PROBE_RESULT))


class ToolTurnTokens:
    """The token ids a tool turn adds after an assistant turn that ended with EOS: the tool messages as the template
    renders them and the next assistant generation prompt. Computed by rendering a probe conversation without and
    with the tool messages and keeping the difference, after the assistant turn's last EOS (what the model itself
    generated), so earlier turns are never re-tokenised. A template whose rendering of earlier turns changes when a
    tool turn is appended cannot be used this way: that is an error naming it."""

    def __init__(self, tokenizer, eos_ids: list[int], chat_template_kwargs: dict | None = None):
        self.tokenizer, extra = text_renderer(tokenizer)  # a processor's template, through its tokenizer
        self.eos_ids = set(eos_ids)
        self.kwargs = {**extra, **(chat_template_kwargs or {})}

    def _ids(self, messages, generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                 return_dict=False, **self.kwargs)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def suffix(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        name = tool_messages[0].get("name", "tool") if tool_messages else "tool"
        head = [{"role": "user", "content": "dummy"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]
        prefix = self._ids(head, generation_prompt=False)
        full = self._ids(head + tool_messages, generation_prompt=True)
        last_eos = max((i for i, t in enumerate(prefix) if t in self.eos_ids), default=None)
        if last_eos is None:
            raise ValueError("the chat template does not end an assistant turn with an EOS token: tool turns cannot be "
                             "appended to generated completions")
        prefix = prefix[:last_eos + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("the chat template re-renders earlier turns when a tool message is appended (it is not "
                             "prefix-preserving): use a template that keeps earlier turns as they are")
        return full[len(prefix):]
