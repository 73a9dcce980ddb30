"""What the LLM judge and the remote reward model share: calling a scoring service over HTTP for a batch of items
with bounded concurrency, a per-request timeout, retries with exponential backoff and jitter, a response cache,
the failure policy and the counts behind the metrics.

Rules (docs/rewards.md has the table):

* An item is what one reward row needs (a judge request, a reward-model text). Identical items in one call are
  sent once; an item answered before (same request, same service) comes from the cache (``cache_size`` entries,
  least recently used dropped; 0 turns it off). Both count as ``cache_hits``. Only successful answers are cached.
* Items are sent in requests of up to ``batch_size`` items, at most ``max_concurrency`` requests at a time, each
  with a ``timeout_s`` limit.
* A request that times out, cannot connect, gets 408 / 409 / 429 / 5xx, or gets a body that is not the JSON the
  service speaks is tried again, up to ``max_retries`` more times, after ``backoff_s * 2**attempt`` seconds with
  jitter (half of it fixed, half uniformly drawn), capped at ``max_backoff_s``; a ``Retry-After`` (or
  ``retry-after-ms``) header is honoured instead, up to ``max_backoff_s``.
* 401, 403 and 404 mean the configuration is wrong (the key, the permission, the URL or the model name): they end
  the run at once whatever ``on_failure`` says. Any other 4xx fails that request without a retry.
* A request that still fails gives its items ``None`` (``on_failure="none"``: the row is left out of the reward,
  counted in ``failures``) or ends the run with :class:`RewardServiceError` naming the cause (``"stop"``).

The API key a client sends is never in a message this module writes: every error text passes through ``redact``.
"""

from __future__ import annotations

import concurrent.futures
import email.utils
import hashlib
import importlib.util
import json
import logging
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..validation import Checker, refusal

logger = logging.getLogger("grpokit")

ON_FAILURE = ("none", "stop")
RETRY_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))
FATAL_STATUSES = frozenset({401, 403, 404})


class RewardServiceError(RuntimeError):
    """A scoring service failed and the run must stop (``on_failure="stop"``, or a configuration error such as 401);
    the message names the reward, the service and the cause, never the key."""


class TransientError(Exception):
    """A request failure worth retrying (timeout, connection, 408/409/429/5xx, a malformed body)."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


class RequestFailed(Exception):
    """A request failure that retrying will not mend (a 4xx other than 401/403/404/408/409/429)."""


class FatalServiceError(Exception):
    """The configuration is wrong (401, 403, 404): the run stops whatever ``on_failure`` says."""


@dataclass(frozen=True)
class ServicePolicy:
    """How a service is called; see the module docstring for the rules."""

    max_concurrency: int = 8
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    on_failure: str = "none"
    cache_size: int = 10_000

    def check(self, owner: str) -> None:
        c = Checker(self, prefix=f"{owner}.")
        c.number("max_concurrency", 1, 1024, integer=True)
        c.number("timeout_s", 0, lo_open=True)
        c.number("max_retries", 0, 100, integer=True)
        c.number("backoff_s", 0)
        c.number("max_backoff_s", 0)
        c.choice("on_failure", ON_FAILURE)
        c.number("cache_size", 0, integer=True)


def policy_from(owner: str, **options: Any) -> ServicePolicy:
    """A checked :class:`ServicePolicy` from a class's keyword arguments."""
    policy = ServicePolicy(**options)
    policy.check(owner)
    return policy


def retry_after_seconds(headers: Any) -> float | None:
    """Seconds a response asks to wait: ``retry-after-ms``, or ``Retry-After`` as seconds or an HTTP date; None if
    absent or unreadable."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
            return value if math.isfinite(value) and value >= 0 else None
        except ValueError:
            pass
    text = headers.get("retry-after")
    if text is None:
        return None
    try:
        value = float(text)
        return value if math.isfinite(value) and value >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def classify_status(status: int, reason: str, retry_after: float | None = None) -> Exception:
    """The exception for an HTTP error status: transient, fatal (401/403/404) or a failed request."""
    if status in RETRY_STATUSES:
        return TransientError(reason, retry_after)
    if status in FATAL_STATUSES:
        return FatalServiceError(reason)
    return RequestFailed(reason)


def request_key(*parts: Any) -> str:
    """A cache key: the SHA-256 of the parts as canonical JSON (the key itself is never part of it)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class CallStats:
    """Counts of one reward call (``requests``: HTTP requests sent, retries included)."""

    items: int = 0
    requests: int = 0
    retries: int = 0
    failures: int = 0
    cache_hits: int = 0
    latencies: list[float] = field(default_factory=list)


class ResponseCache:
    """An LRU cache of successful answers, safe to use from several threads."""

    def __init__(self, size: int):
        self.size = size
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bool, Any]:
        with self._lock:
            if key not in self._data:
                return False, None
            self._data.move_to_end(key)
            return True, self._data[key]

    def put(self, key: str, value: Any) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


class ServiceCaller:
    """Runs one service's requests: ``send(items) -> answers`` (one answer per item, raising one of this module's
    exceptions on failure) under a :class:`ServicePolicy`. ``describe`` names the service in messages (the URL, never
    the key); ``redact`` scrubs any message of the key."""

    def __init__(self, name: str, policy: ServicePolicy, describe: str, redact: Callable[[str], str] = str,
                 rng: random.Random | None = None):
        self.name, self.policy, self.describe, self.redact = name, policy, describe, redact
        self.cache = ResponseCache(policy.cache_size)
        self._rng = rng or random.Random()
        self._lock = threading.Lock()

    def backoff(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before retry number ``attempt + 1``: ``Retry-After`` when given, else exponential with jitter;
        never above ``max_backoff_s``."""
        p = self.policy
        if retry_after is not None:
            return min(p.max_backoff_s, retry_after)
        delay = min(p.max_backoff_s, p.backoff_s * 2 ** attempt)
        return delay / 2 + self._rng.uniform(0, delay / 2)

    def call(self, items: Sequence[Any], keys: Sequence[str], send: Callable[[list], list],
             batch_size: int = 1) -> tuple[list[Any], CallStats]:
        """The answer per item (None where it failed under ``on_failure="none"``) and the call's counts."""
        stats = CallStats(items=len(items))
        answers: dict[str, Any] = {}
        todo: dict[str, Any] = {}
        for item, key in zip(items, keys):
            if key in answers or key in todo:
                stats.cache_hits += 1
                continue
            hit, value = self.cache.get(key)
            if hit:
                answers[key] = value
                stats.cache_hits += 1
            else:
                todo[key] = item
        pending = list(todo.items())
        batches = [pending[i:i + batch_size] for i in range(0, len(pending), batch_size)]
        if batches:
            self._run_batches(batches, send, stats, answers)
        return [answers.get(k) for k in keys], stats

    def _run_batches(self, batches: list[list], send, stats: CallStats, answers: dict[str, Any]) -> None:
        workers = min(self.policy.max_concurrency, len(batches))
        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"grpokit-{self.name}")
        abort = threading.Event()  # set when the run must stop: waiting retries give up at once
        try:
            futures = {pool.submit(self._one_request, [item for _, item in batch], send, stats, abort): batch
                       for batch in batches}
            for future in concurrent.futures.as_completed(futures):
                batch = futures[future]
                try:
                    values = future.result()
                except RewardServiceError:
                    abort.set()
                    raise
                if values is None:
                    continue
                for (key, _), value in zip(batch, values):
                    answers[key] = value
                    self.cache.put(key, value)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _one_request(self, items: list, send, stats: CallStats, abort: threading.Event) -> list | None:
        """One request with its retries; None when it failed and ``on_failure`` is ``"none"``."""
        p = self.policy
        for attempt in range(p.max_retries + 1):
            if abort.is_set():
                return None
            start = time.monotonic()
            with self._lock:
                stats.requests += 1
                stats.retries += attempt > 0
            try:
                values = send(items)
            except TransientError as e:
                if attempt < p.max_retries:
                    abort.wait(self.backoff(attempt, e.retry_after))
                    continue
                return self._failed(items, stats, f"{e} (after {attempt + 1} attempts)")
            except RequestFailed as e:
                return self._failed(items, stats, str(e))
            except FatalServiceError as e:
                raise RewardServiceError(self.redact(
                    f"reward {self.name!r}: {self.describe} refused the request: {e} (a wrong key, permission, "
                    "URL or model name; the run stops whatever on_failure says)")) from None
            with self._lock:
                stats.latencies.append(time.monotonic() - start)
            return values
        raise AssertionError("unreachable")

    def _failed(self, items: list, stats: CallStats, cause: str) -> None:
        cause = self.redact(cause)
        with self._lock:
            stats.failures += len(items)
        if self.policy.on_failure == "stop":
            raise RewardServiceError(f"reward {self.name!r}: {self.describe} failed: {cause} (on_failure='stop')")
        logger.debug("reward %r: %s failed: %s; the row gets None", self.name, self.describe, cause)
        return None


class MetricLog:
    """A reward instance's counts: every call's added to ``totals``; each call's reported through the trainer's
    ``log_metric`` as ``rewards/<name>/<count>`` when it passes one."""

    def __init__(self, name: str):
        self.name = name
        self.totals: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, counts: dict[str, float], log_metric: Callable[[str, float], None] | None) -> None:
        with self._lock:
            for k, v in counts.items():
                if not k.endswith("_s"):
                    self.totals[k] = self.totals.get(k, 0) + v
        if log_metric is not None:
            for k, v in counts.items():
                log_metric(f"rewards/{self.name}/{k}", float(v))


def service_counts(stats: CallStats) -> dict[str, float]:
    """The counts of a service call as metrics: ``requests``, ``retries``, ``failures``, ``cache_hits`` and, when a
    request was answered, ``latency_s`` (the mean seconds of an answered request)."""
    out = {"requests": stats.requests, "retries": stats.retries, "failures": stats.failures,
           "cache_hits": stats.cache_hits}
    if stats.latencies:
        out["latency_s"] = sum(stats.latencies) / len(stats.latencies)
    return out


def api_key_from_env(owner: str, api_key_env: str | None) -> str | None:
    """The key in the environment variable ``api_key_env`` names; an unset or empty variable is one error line
    naming the variable (never a value)."""
    import os

    if api_key_env is None:
        return None
    if not isinstance(api_key_env, str) or not api_key_env.strip() or "=" in api_key_env:
        raise refusal("api_key_env", api_key_env, "expected the name of an environment variable that holds the key "
                      "(never the key itself)", prefix=f"{owner}.")
    value = os.environ.get(api_key_env)
    if not value:
        raise ValueError(f"{owner}.api_key_env={api_key_env!r}: that environment variable is not set (export it "
                         "before the run; the key is read from it and never written anywhere)")
    return value


def make_redactor(secret: str | None) -> Callable[[str], str]:
    """A function that replaces ``secret`` in a text by ``***``."""
    if not secret:
        return str
    return lambda text: str(text).replace(secret, "***")


def check_name(owner: str, name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or "/" in name or any(ch.isspace() for ch in name):
        raise refusal("name", name, "expected a short name without spaces or '/' (it names the metrics "
                      "rewards/<name>/...)", prefix=f"{owner}.")
    return name


def check_base_url(owner: str, base_url: Any) -> str:
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise refusal("base_url", base_url, "expected an http:// or https:// URL", prefix=f"{owner}.")
    return base_url.rstrip("/")


def missing_extra(owner: str, package: str) -> ImportError:
    return ImportError(f"{owner} needs the {package!r} package: pip install 'grpokit[services]'")


class HttpRewardService:
    """What every HTTP scoring service shares (:class:`grpokit.rewards.LLMJudge`,
    :class:`grpokit.rewards.RemoteRewardModel`): its name, base URL and failure policy checked in one line each, the
    API key read from its environment variable (an unset one fails before any model loads) and redacted from every
    message, the client package checked, a lazily made client behind a lock, the caller (concurrency, retries, cache,
    counts) and the metric log, pickling without any of those, ``stats`` and ``repr``. A subclass sets
    :attr:`package` and :attr:`serves` and makes its client in :meth:`_make_client`; a new service is one class."""

    package: str = ""
    """The client package it needs (an extra of grpokit's)."""
    serves: str = "the service"
    """What sits at the base URL, for messages: ``"<serves> at <base_url>"``."""
    repr_fields: tuple[str, ...] = ()
    """Fields shown in ``repr`` after the name and base URL."""
    _unpickled = ("_client", "_lock", "_redact", "_caller", "metrics")

    def _init_service(self, base_url: Any, name: Any, api_key_env: str | None, **policy: Any) -> None:
        owner = type(self).__name__
        self.__name__ = check_name(owner, name)
        self.base_url = check_base_url(owner, base_url)
        self.policy = policy_from(owner, **policy)
        self.api_key_env = api_key_env
        api_key_from_env(owner, api_key_env)  # an unset variable fails here, before any model is loaded
        if importlib.util.find_spec(self.package) is None:
            raise missing_extra(owner, self.package)
        self._setup()

    def _setup(self) -> None:
        """What is not pickled: the client, its lock, the caller (cache, counts) and the key's redactor."""
        self._client = None
        self._lock = threading.Lock()
        self._redact: Callable[[str], str] = make_redactor(self._api_key())
        self._caller = ServiceCaller(self.__name__, self.policy, f"{self.serves} at {self.base_url}", self._redact)
        self.metrics = MetricLog(self.__name__)

    def _api_key(self) -> str | None:
        return api_key_from_env(type(self).__name__, self.api_key_env)

    def _get_client(self):
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self):
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._unpickled}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def __repr__(self) -> str:
        fields = "".join(f", {f}={getattr(self, f)!r}" for f in self.repr_fields)
        key = f", api_key_env={self.api_key_env!r}" if self.api_key_env else ""
        return f"{type(self).__name__}(name={self.__name__!r}, base_url={self.base_url!r}{fields}{key})"

    @property
    def stats(self) -> dict[str, float]:
        """Counts over every call so far (requests, retries, failures, cache hits, and the service's own)."""
        return dict(self.metrics.totals)
