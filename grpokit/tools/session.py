"""What a trainer with ``tools=`` and/or ``environment_factory=`` does around generation: check the tools and the
chat template before anything runs, give every rollout its environment and its tools, and run the multi-turn loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..bounds.user_calls import CallBounds, Incidents
from ..bounds.watchdog import stage
from .environments import Environments, reset_all, reset_prompt
from .loop import ToolRollouts, run_tool_loop
from .parsing import detect_style
from .templates import supports_tool_calls

logger = logging.getLogger("grpokit")


def check_tools(tools: Any) -> list[Callable]:
    """The tools as a list of documented functions (their JSON schemas are built from type hints and Google-style
    docstrings); a tool that cannot be described is an error naming it and why."""
    if tools is None:
        return []
    if callable(tools) or not isinstance(tools, (list, tuple)):
        tools = [tools]
    from transformers.utils import get_json_schema

    out = []
    for tool in tools:
        if not callable(tool) or not hasattr(tool, "__name__"):
            raise ValueError(f"tools entry {tool!r:.80} is not a function; tools are plain or async functions with "
                             "type hints and a Google-style docstring")
        try:
            get_json_schema(tool)
        except Exception as e:  # noqa: BLE001 - transformers raises several kinds for undescribable functions
            raise ValueError(f"tool {tool.__name__!r} cannot be described to the model: {e} (every argument needs a "
                             "type hint and an 'Args:' entry in the docstring)") from None
        out.append(tool)
    names = [t.__name__ for t in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"tools {dupes} are given more than once (tools are called by name)")
    return out


@dataclass
class TurnLimits:
    """Where a multi-turn rollout stops besides ``max_tool_calling_iterations``."""

    eos_ids: list[int]
    """Tokens that end a reply (only a finished reply's tool calls run)."""
    max_completion_length: int
    """Every reply and tool turn of a rollout together."""
    max_model_len: int | None = None
    """Prompt and completion together (the model's context)."""


@dataclass
class PreparedRows:
    rows: list[dict]
    """The rows with every environment's reset observation appended to their prompts."""
    environments: list | None
    tools_per_row: list[list[Callable]]
    tool_dicts: list[dict[str, Callable]]


class MultiTurn:
    def __init__(self, tools: list[Callable], environment_factory, max_iterations: int | None,
                 chat_template_kwargs: dict | None = None):
        self.tools = tools
        self.environments = Environments(environment_factory) if environment_factory is not None else None
        self.max_iterations = max_iterations
        self.chat_template_kwargs = chat_template_kwargs
        self.style: str | None = None
        if self.environments is not None:  # environment methods must be describable too
            for name in self.environments.factories:
                check_tools(self.environments.tools_for(name))

    @property
    def has_tools(self) -> bool:
        return bool(self.tools) or (self.environments is not None and any(self.environments.methods.values()))

    def check_template(self, tokenizer) -> None:
        """The chat template must render tool calls and their results, in a format grpokit can read back."""
        if not self.has_tools:
            return
        template = getattr(tokenizer, "chat_template", None)
        if not supports_tool_calls(tokenizer, self.chat_template_kwargs):
            raise ValueError("the tokenizer's chat template does not render tool calls (user → assistant tool call → "
                             "tool result); use a tool-capable template, e.g. for a ChatML model: "
                             "tokenizer.chat_template = grpokit.tools.CHATML_TOOLS_TEMPLATE")
        self.style = detect_style(template if isinstance(template, str) else None)
        if self.style is None:
            raise ValueError("the chat template's tool-call format is not one grpokit reads (hermes <tool_call>, "
                             "Llama 3 JSON, Mistral [TOOL_CALLS])")

    def reward_funcs(self) -> list[Callable]:
        return self.environments.reward_funcs() if self.environments is not None else []

    def prepare(self, rows: list[dict], bounds: CallBounds | None = None,
                incidents: Incidents | None = None) -> PreparedRows:
        """Each row's environment (reset with the row, its observation appended to the prompt) and tools; every
        environment call within ``bounds.tool_timeout_s`` (timeouts and cut observations counted into ``incidents``)."""
        envs = None
        if self.environments is not None:
            bounds = bounds or CallBounds()
            incidents = incidents if incidents is not None else Incidents()
            envs = self.environments.acquire(rows, bounds.tool_timeout_s)
            with stage("environment", method="reset", rows=len(rows)):
                observations = reset_all(envs, rows, bounds, incidents)
            rows = [dict(r, prompt=reset_prompt(r.get("prompt") or [{"role": "user", "content": ""}], o))
                    for r, o in zip(rows, observations)]
        tools_per_row = []
        for i, row in enumerate(rows):
            tools = list(self.tools)
            if envs is not None:
                tools += [getattr(envs[i], m) for m in self.environments.methods[self.environments.name_of(row)]]
            tools_per_row.append(tools)
        return PreparedRows(rows=rows, environments=envs, tools_per_row=tools_per_row,
                            tool_dicts=[{t.__name__: t for t in tools} for tools in tools_per_row])

    def loop(self, generate, prompts, first, prepared: PreparedRows, tokenizer, limits: TurnLimits,
             bounds: CallBounds | None = None, incidents: Incidents | None = None) -> ToolRollouts:
        """The tool loop from the first replies ``first`` to ``prompts`` (a :class:`grpokit.rollout.base.PromptBatch`,
        its images given to every later turn; see :func:`grpokit.tools.loop.run_tool_loop`)."""
        return run_tool_loop(generate, prompts, first, tokenizer, prepared.tool_dicts, self.style, limits.eos_ids,
                             self.max_iterations, limits.max_completion_length, limits.max_model_len,
                             self.chat_template_kwargs, bounds, incidents, prepared.environments)


def multiturn_parts(tools, environment_factory, args):
    """The trainer's tools and environments (None without either); checked before any model is loaded."""
    tools = check_tools(tools)
    if not tools and environment_factory is None:
        if args.max_tool_calling_iterations is not None:
            logger.warning("max_tool_calling_iterations=%s has no effect without tools or an environment_factory",
                           args.max_tool_calling_iterations)
        return None
    return MultiTurn(tools, environment_factory, args.max_tool_calling_iterations, args.chat_template_kwargs)

