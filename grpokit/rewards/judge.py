"""``LLMJudge``: a reward function that asks a chat model behind any OpenAI-compatible endpoint (vLLM, SGLang,
``transformers serve``, llama.cpp's server, hosted APIs) to grade each completion, through the ``openai`` client
(``pip install 'grpokit[services]'``).

>>> judge = LLMJudge(base_url="http://localhost:8000/v1", model="Qwen/Qwen2.5-7B-Instruct",
...                  prompt="Question: {prompt}\\nAnswer: {completion}\\nReference: {answer}\\n"
...                         "Is the answer right? Reply yes or no.", labels={"yes": 1.0, "no": 0.0})
>>> judge(prompts=["2+2?"], completions=["4"], answer=["4"])            # doctest: +SKIP
[1.0]

The prompt template is filled with ``{prompt}`` (the prompt's text: a plain prompt as is, a chat prompt's last user
message), ``{completion}`` (the completion's text) and ``{<column>}`` for any dataset column; literal braces are
written ``{{`` and ``}}``. Reading the reply: :mod:`grpokit.rewards.judge_parsing`; calling the service (concurrency,
timeouts, retries, the cache, the failure policy): :mod:`grpokit.rewards.service`. An unreadable reply gives
``None`` and is counted in ``parse_failures``; it is not asked again (a judge at temperature 0 would answer the same).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any

from ..validation import refusal
from .builtin import completion_text
from .classes import reward_class
from .judge_parsing import ScoreRule, parse_score
from .service import (
    HttpRewardService,
    RequestFailed,
    TransientError,
    classify_status,
    request_key,
    retry_after_seconds,
    service_counts,
)

__all__ = ["LLMJudge", "prompt_text"]

REPLY_LOG_CHARS = 500
"""A judge's reply is logged (``log_extra``, the completions table) up to this many characters."""


def prompt_text(prompt: Any) -> str:
    """A prompt as text: a string as is, a chat prompt's last user message (its text parts joined)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        for message in reversed(prompt):
            if isinstance(message, dict) and message.get("role") == "user":
                return completion_text([{**message, "role": "assistant"}])
        return completion_text([{**m, "role": "assistant"} for m in prompt if isinstance(m, dict)])
    return "" if prompt is None else str(prompt)


def template_fields(owner: str, what: str, template: Any) -> list[str]:
    """The ``{name}`` fields of a prompt template; anything but plain names is one error line."""
    if not isinstance(template, str) or not template.strip():
        raise refusal(what, template, "expected a non-empty template string", prefix=f"{owner}.")
    fields = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{owner}.{what} is not a valid template ({e}); write literal braces as {{{{ and }}}}") \
            from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"{owner}.{what} has the field {{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}}: only plain names such as {{prompt}}, {{completion}} "
                             "or {column} are allowed (literal braces: {{ and }})")
        fields.append(name)
    return fields


@reward_class
class LLMJudge(HttpRewardService):
    """A reward function whose scores come from a chat model grading each completion (see the module docstring).

    Args:
        base_url: the endpoint's base URL, e.g. ``http://localhost:8000/v1``.
        model: the model name the endpoint serves.
        prompt: the user message, a template (``{prompt}``, ``{completion}``, ``{<column>}``).
        system: an optional system message, a template too.
        api_key_env: the name of the environment variable holding the API key (None: no key is sent).
        name: the name metrics are logged under (``rewards/<name>/mean``, ``rewards/<name>/retries``, ...).
        score_range, normalize, labels, json_field, pattern: how a reply becomes a score
            (:mod:`grpokit.rewards.judge_parsing`); by default the first number in the reply, in [0, 10], divided by
            10.
        temperature, max_tokens, extra_body: sent with each request (``extra_body``: more fields of the request body).
        max_concurrency, timeout_s, max_retries, backoff_s, max_backoff_s, on_failure, cache_size: how the endpoint
            is called (:mod:`grpokit.rewards.service`).

    ``stats``: requests, retries, failures, cache_hits and parse_failures over every call so far.
    """

    package, serves, repr_fields = "openai", "the judge", ("model",)

    def __init__(self, base_url: str, model: str, prompt: str, *, system: str | None = None,
                 api_key_env: str | None = None, name: str = "llm_judge",
                 score_range: Sequence[float] = (0.0, 10.0), normalize: bool = True,
                 labels: dict[str, float] | None = None, json_field: str | None = None, pattern: str | None = None,
                 temperature: float = 0.0, max_tokens: int = 256, extra_body: dict[str, Any] | None = None,
                 max_concurrency: int = 8, timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, on_failure: str = "none", cache_size: int = 10_000):
        owner = "LLMJudge"
        if not isinstance(model, str) or not model.strip():
            raise refusal("model", model, "expected the model name the endpoint serves", prefix=f"{owner}.")
        self.model = model
        self.prompt, self.system = prompt, system
        self.fields = template_fields(owner, "prompt", prompt)
        if system is not None:
            self.fields += template_fields(owner, "system", system)
        self.rule = ScoreRule(score_range, normalize, labels, json_field, pattern).check(owner)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise refusal("temperature", temperature, "expected a number in [0, 2]", prefix=f"{owner}.")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise refusal("max_tokens", max_tokens, "expected a positive integer", prefix=f"{owner}.")
        if extra_body is not None and not isinstance(extra_body, dict):
            raise refusal("extra_body", extra_body, "expected a mapping", prefix=f"{owner}.")
        self.temperature, self.max_tokens, self.extra_body = float(temperature), max_tokens, dict(extra_body or {})
        self._init_service(base_url, name, api_key_env, max_concurrency=max_concurrency, timeout_s=timeout_s,
                           max_retries=max_retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                           on_failure=on_failure, cache_size=cache_size)

    def _make_client(self):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self._api_key() or "none",  # local servers want no key
                             max_retries=0, timeout=self.policy.timeout_s)

    def request(self, prompt: Any, completion: Any, row: dict[str, Any]) -> dict[str, Any]:
        """The chat request for one row (the body sent, without the key)."""
        values = {"prompt": prompt_text(prompt), "completion": completion_text(completion)}
        for name in self.fields:
            if name not in values:
                if name not in row:
                    raise ValueError(f"reward {self.__name__!r}: the prompt template uses {{{name}}}, and the batch has "
                                     f"no column {name!r} (columns: {', '.join(sorted(row)) or 'none'})")
                values[name] = "" if row[name] is None else str(row[name])
        messages = [{"role": "user", "content": self.prompt.format(**values)}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system.format(**values)})
        return {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "extra_body": self.extra_body}

    def _send(self, items: list[dict[str, Any]]) -> list[str]:
        import openai

        (body,) = items
        try:
            reply = self._get_client().chat.completions.create(**body, timeout=self.policy.timeout_s)
        except openai.APITimeoutError:
            raise TransientError(f"no answer within timeout_s={self.policy.timeout_s:g}") from None
        except openai.APIConnectionError as e:
            raise TransientError(f"connection failed ({type(e.__cause__ or e).__name__})") from None
        except openai.APIStatusError as e:
            text = str(getattr(e, "message", "") or "")[:200]
            raise classify_status(e.status_code, f"HTTP {e.status_code}: {text}",
                                  retry_after_seconds(e.response.headers)) from None
        except ValueError as e:  # the body was not JSON (json.JSONDecodeError)
            raise TransientError(f"the response was not valid JSON ({type(e).__name__})") from None
        try:
            content = reply.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            raise TransientError("the response was not a chat completion") from None
        if content is not None and not isinstance(content, str):
            raise RequestFailed("the response's message content was not text")
        return [content or ""]

    def __call__(self, prompts: Sequence | None = None, completions: Sequence | None = None,
                 completion_ids: Sequence | None = None, trainer_state: Any = None, *,
                 log_metric: Callable[[str, float], None] | None = None,
                 log_extra: Callable[[str, list], None] | None = None, **columns: Any) -> list[float | None]:
        completions = list(completions or [])
        n = len(completions)
        prompts = list(prompts) if prompts is not None else [""] * n
        lists = {k: v for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == n}
        bodies = [self.request(prompts[i], completions[i], {k: v[i] for k, v in lists.items()}) for i in range(n)]
        keys = [request_key(self.base_url, body) for body in bodies]
        replies, stats = self._caller.call(bodies, keys, self._send)
        scores = [None if reply is None else parse_score(reply, self.rule) for reply in replies]
        counts = service_counts(stats)
        counts["parse_failures"] = sum(1 for r, s in zip(replies, scores) if r is not None and s is None)
        self.metrics.record(counts, log_metric)
        if log_extra is not None:
            log_extra(f"{self.__name__}_reply", [None if r is None else r[:REPLY_LOG_CHARS] for r in replies])
        return scores
