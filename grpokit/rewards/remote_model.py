"""``RemoteRewardModel``: a sequence-classification reward model served behind HTTP, as a reward function, through
``httpx`` (``pip install 'grpokit[services]'``). Two wire formats:

* ``api="tei"`` (text-embeddings-inference): ``POST {base_url}/predict`` with ``{"inputs": [text, ...],
  "raw_scores": true, "truncate": true}``; the answer holds, per text, a list of ``{"label", "score"}``. The reward
  is the score of ``label`` (a label name, or an index ``i`` meaning ``LABEL_i``, default 0): with ``raw_scores``
  the model's logit, as a reward model in the trainer gives it.
* ``api="vllm"`` (vLLM's and SGLang's classification API): ``POST {base_url}/classify`` with ``{"model": model,
  "input": [text, ...]}``; the reward is ``data[i].probs[label]`` (``label`` an index), the probabilities the
  server computes.

The text of a row is the prompt followed by the completion (plain prompts), or a chat prompt and the completion
rendered with the chat template of ``tokenizer`` (a local directory or hub id whose tokenizer is loaded on first
use). Texts go out in requests of ``batch_size``; calling the service (concurrency, timeouts, retries, the cache,
the failure policy): :mod:`grpokit.rewards.service`. The cache is per text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..validation import Checker
from .builtin import completion_text
from .classes import reward_class
from .service import (
    HttpRewardService,
    RequestFailed,
    TransientError,
    classify_status,
    request_key,
    retry_after_seconds,
    service_counts,
)

__all__ = ["RemoteRewardModel"]

APIS = ("tei", "vllm")


def _check_options(owner: str, options: dict[str, Any]) -> None:
    """:class:`RemoteRewardModel`'s own keyword arguments, one error line for the first wrong one."""
    check = Checker(options, prefix=f"{owner}.", get=dict.get)
    check.choice("api", APIS)
    api, model, label = options["api"], options["model"], options["label"]
    if api == "vllm" and (not isinstance(model, str) or not model.strip()):
        raise check.bad("model", "api 'vllm' needs the served model's name")
    if model is not None and not isinstance(model, str):
        raise check.bad("model", "expected the served model's name")
    label_ok = (isinstance(label, int) and not isinstance(label, bool) and label >= 0) or (
        api == "tei" and isinstance(label, str) and label.strip())
    if not label_ok:
        raise check.bad("label", "expected an output index >= 0"
                        + (" or a label name" if api == "tei" else " (api 'vllm' returns probabilities by index)"))
    check.boolean("raw_scores")
    batch_size, tokenizer = options["batch_size"], options["tokenizer"]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 4096:
        raise check.bad("batch_size", "expected an integer in [1, 4096]")
    if tokenizer is not None and (not isinstance(tokenizer, str) or not tokenizer.strip()):
        raise check.bad("tokenizer", "expected a tokenizer directory or id")


@reward_class
class RemoteRewardModel(HttpRewardService):
    """A reward function whose scores come from a reward model served elsewhere (see the module docstring).

    Args:
        base_url: the server, e.g. ``http://localhost:8080`` (TEI) or ``http://localhost:8000`` (vLLM).
        api: ``"tei"`` or ``"vllm"``.
        model: the served model's name (required by ``"vllm"``, unused by ``"tei"``).
        label: which output is the reward: an index (default 0) or, for ``"tei"``, a label name.
        raw_scores: ``"tei"`` only: ask for logits (default) rather than probabilities.
        batch_size: texts per request.
        tokenizer: a tokenizer (directory or hub id) whose chat template renders chat prompts; needed only for them.
        api_key_env: the name of the environment variable holding a bearer token (None: none is sent).
        name: the name metrics are logged under (``rewards/<name>/...``).
        max_concurrency, timeout_s, max_retries, backoff_s, max_backoff_s, on_failure, cache_size: how the server is
            called (:mod:`grpokit.rewards.service`).

    ``stats``: requests, retries, failures and cache_hits over every call so far.
    """

    package, serves, repr_fields = "httpx", "the reward model", ("api",)
    _unpickled = (*HttpRewardService._unpickled, "_tokenizer")

    def __init__(self, base_url: str, *, api: str = "tei", model: str | None = None, label: int | str = 0,
                 raw_scores: bool = True, batch_size: int = 16, tokenizer: str | None = None,
                 api_key_env: str | None = None, name: str = "remote_reward_model", max_concurrency: int = 4,
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 on_failure: str = "none", cache_size: int = 10_000):
        _check_options("RemoteRewardModel", dict(api=api, model=model, label=label, raw_scores=raw_scores,
                                                 batch_size=batch_size, tokenizer=tokenizer))
        self.api, self.model, self.label, self.raw_scores = api, model, label, raw_scores
        self.batch_size, self.tokenizer_name = batch_size, tokenizer
        self._init_service(base_url, name, api_key_env, max_concurrency=max_concurrency, timeout_s=timeout_s,
                           max_retries=max_retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                           on_failure=on_failure, cache_size=cache_size)

    def _setup(self) -> None:
        """What is not pickled: the HTTP client, the tokenizer, the caller (cache, counts) and the key's redactor."""
        super()._setup()
        self._tokenizer = None

    def _make_client(self):
        import httpx

        key = self._api_key()
        return httpx.Client(timeout=self.policy.timeout_s, headers={"Authorization": f"Bearer {key}"} if key else {})

    def _chat_text(self, prompt: list, completion: Any) -> str:
        with self._lock:
            if self._tokenizer is None:
                if self.tokenizer_name is None:
                    raise ValueError(f"reward {self.__name__!r}: chat prompts need RemoteRewardModel(tokenizer=...) "
                                     "(a tokenizer whose chat template renders them as the reward model was trained)")
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        return self._tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)

    def text(self, prompt: Any, completion: Any) -> str:
        """What the reward model reads for one row."""
        if isinstance(prompt, list):
            return self._chat_text(prompt, completion)
        return ("" if prompt is None else str(prompt)) + completion_text(completion)

    def _request(self, texts: list[str]) -> tuple[str, dict[str, Any]]:
        if self.api == "tei":
            return "/predict", {"inputs": texts, "raw_scores": self.raw_scores, "truncate": True}
        return "/classify", {"model": self.model, "input": texts}

    def _send(self, texts: list[str]) -> list[float]:
        import httpx

        path, body = self._request(texts)
        try:
            response = self._get_client().post(self.base_url + path, json=body)
        except httpx.TimeoutException:
            raise TransientError(f"no answer within timeout_s={self.policy.timeout_s:g}") from None
        except httpx.TransportError as e:
            raise TransientError(f"connection failed ({type(e).__name__})") from None
        if response.status_code >= 400:
            raise classify_status(response.status_code, f"HTTP {response.status_code}: {response.text[:200]}",
                                  retry_after_seconds(response.headers))
        try:
            data = response.json()
        except ValueError:
            raise TransientError("the response was not valid JSON") from None
        return self._scores(data, len(texts))

    def _scores(self, data: Any, n: int) -> list[float]:
        try:
            if self.api == "tei":
                if n == 1 and isinstance(data, list) and data and isinstance(data[0], dict):
                    data = [data]  # one input may come back unnested
                name = self.label if isinstance(self.label, str) else f"LABEL_{self.label}"
                scores = [next(float(p["score"]) for p in row if p["label"] == name) for row in data]
            else:
                rows = sorted(data["data"], key=lambda d: d["index"])
                scores = [float(row["probs"][self.label]) for row in rows]
        except (KeyError, IndexError, TypeError, ValueError, StopIteration, AttributeError):
            raise RequestFailed(f"the response is not a {self.api!r} classification answer with output "
                                f"{self.label!r}") from None
        if len(scores) != n or not all(math.isfinite(s) for s in scores):
            raise RequestFailed(f"the response has {len(scores)} scores for {n} texts, or a non-finite one")
        return scores

    def __call__(self, prompts: Sequence | None = None, completions: Sequence | None = None,
                 completion_ids: Sequence | None = None, trainer_state: Any = None, *,
                 log_metric: Callable[[str, float], None] | None = None, **columns: Any) -> list[float | None]:
        completions = list(completions or [])
        prompts = list(prompts) if prompts is not None else [""] * len(completions)
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        identity = (self.base_url, self.api, self.model, self.label, self.raw_scores)
        keys = [request_key(*identity, t) for t in texts]
        scores, stats = self._caller.call(texts, keys, self._send, batch_size=self.batch_size)
        self.metrics.record(service_counts(stats), log_metric)
        return scores
