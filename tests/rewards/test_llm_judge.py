"""LLMJudge against a fault-injecting OpenAI-compatible server: the documented retry, timeout, cache and failure
rules with their counts, the request it sends, its metrics, and the API key kept out of everything it says."""

import pickle
import sys
import time

import pytest
from service_servers import FaultServer, closed_port

from grpokit.rewards import LLMJudge, RewardFunctionError, RewardServiceError, score_completions

SECRET = "sk-test-a1b2c3d4e5f6-never-in-a-file"
TEMPLATE = "Question: {prompt}\nReply: {completion}\nReference: {answer}\nGive a score from 0 to 10."


@pytest.fixture
def server():
    with FaultServer() as s:
        yield s


def judge(url, **kw):
    options = dict(model="judge", prompt=TEMPLATE, max_retries=2, timeout_s=5.0, backoff_s=0.05, max_backoff_s=1.0,
                   max_concurrency=1)
    options.update(kw)
    return LLMJudge(base_url=url + "/v1", **options)


def call(j, n=1, log=None, **kw):
    completions = kw.pop("completions", [f"reply {i}" for i in range(n)])
    return j(prompts=[[{"role": "user", "content": f"q{i}"}] for i in range(len(completions))],
             completions=[[{"role": "assistant", "content": c}] for c in completions],
             answer=[str(i) for i in range(len(completions))],
             log_metric=None if log is None else lambda k, v: log.setdefault(k, []).append(v), **kw)


def test_a_good_answer_and_the_request_sent(server):
    j = judge(server.url, system="You grade {answer}.")
    assert call(j) == [pytest.approx(0.8)]
    (req,) = server.requests
    assert req["path"] == "/v1/chat/completions"
    body = req["body"]
    assert body["model"] == "judge" and body["temperature"] == 0.0 and body["max_tokens"] == 256
    assert body["messages"] == [{"role": "system", "content": "You grade 0."},
                                {"role": "user", "content": "Question: q0\nReply: reply 0\nReference: 0\n"
                                                            "Give a score from 0 to 10."}]
    assert j.stats == {"requests": 1, "retries": 0, "failures": 0, "cache_hits": 0, "parse_failures": 0}


def test_429_with_retry_after_waits_as_told(server):
    server.script.extend([("status", 429, {"Retry-After": "0.4"})])
    j = judge(server.url)
    assert call(j) == [pytest.approx(0.8)]
    first, second = server.requests
    assert second["time"] - first["time"] >= 0.4  # a lower bound: the wait asked for (no upper bound asserted)
    assert j.stats["requests"] == 2 and j.stats["retries"] == 1 and j.stats["failures"] == 0


def test_429_without_retry_after_backs_off_exponentially(server):
    server.script.extend([("status", 429, {}), ("status", 429, {})])
    j = judge(server.url, backoff_s=0.2)
    assert call(j) == [pytest.approx(0.8)]
    t = [r["time"] for r in server.requests]
    assert t[1] - t[0] >= 0.1 and t[2] - t[1] >= 0.2  # half of 0.2 * 2**attempt is fixed, half jitter
    assert j.stats["retries"] == 2


def test_backoff_has_jitter_and_a_cap():
    j = LLMJudge(base_url="http://127.0.0.1:1/v1", model="m", prompt="{completion}", backoff_s=1.0, max_backoff_s=3.0)
    caller = j._caller
    waits = [caller.backoff(1, None) for _ in range(50)]
    assert all(1.0 <= w <= 2.0 for w in waits) and len(set(waits)) > 1
    assert all(1.5 <= caller.backoff(5, None) <= 3.0 for _ in range(20))  # 32 s capped at 3
    assert caller.backoff(0, 2.5) == 2.5 and caller.backoff(0, 60.0) == 3.0  # Retry-After, capped too


@pytest.mark.parametrize("fault", [("status", 500, {}), ("status", 503, {}), ("broken",), ("drop",)])
def test_5xx_broken_json_and_a_dropped_connection_are_retried(server, fault):
    server.script.append(fault)
    j = judge(server.url)
    assert call(j) == [pytest.approx(0.8)]
    assert j.stats["requests"] == 2 and j.stats["retries"] == 1 and j.stats["failures"] == 0


def test_a_slow_answer_times_out_and_is_retried(server):
    server.script.append(("slow", 2.0))
    j = judge(server.url, timeout_s=0.3)
    assert call(j) == [pytest.approx(0.8)]
    assert j.stats["requests"] == 2 and j.stats["retries"] == 1


def test_retries_run_out_none_and_a_counted_failure(server):
    server.script.extend([("status", 500, {})] * 3)
    log = {}
    j = judge(server.url)
    assert call(j, log=log) == [None]
    assert j.stats == {"requests": 3, "retries": 2, "failures": 1, "cache_hits": 0, "parse_failures": 0}
    assert log["rewards/llm_judge/failures"] == [1.0] and log["rewards/llm_judge/retries"] == [2.0]
    assert "rewards/llm_judge/latency_s" not in log  # nothing was answered


def test_connection_refused():
    j = judge(f"http://127.0.0.1:{closed_port()}", max_retries=1)
    assert call(j, n=2) == [None, None]
    assert j.stats["requests"] == 4 and j.stats["failures"] == 2


def test_a_400_is_not_retried(server):
    server.script.append(("status", 400, {}))
    j = judge(server.url)
    assert call(j) == [None]
    assert j.stats["requests"] == 1 and j.stats["failures"] == 1


def test_stop_policy_ends_the_call_with_the_cause_and_no_row_by_row_retries(server):
    server.script.extend([("status", 500, {})] * 3)
    j = judge(server.url, on_failure="stop")
    with pytest.raises(RewardFunctionError, match=r"reward 'llm_judge': the judge at http://127.0.0.1:\d+/v1 failed: "
                                                  r"HTTP 500.*after 3 attempts.*on_failure='stop'"):
        score_completions([j], [None], prompts=["q"], completions=["c"], completion_ids=[[1]], rows=[{"answer": "1"}])
    assert len(server.requests) == 3  # scoring did not call the judge again row by row


@pytest.mark.parametrize("status", [401, 403, 404])
def test_configuration_errors_stop_the_run_and_never_show_the_key(server, monkeypatch, status):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    server.script.append(("status", status, {}))
    j = judge(server.url, api_key_env="JUDGE_KEY")
    with pytest.raises(RewardServiceError) as info:
        call(j)
    assert f"HTTP {status}" in str(info.value) and "whatever on_failure says" in str(info.value)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)
    assert server.requests[0]["headers"]["authorization"] == f"Bearer {SECRET}"  # the key was sent, only there


def test_the_key_stays_out_of_repr_pickles_and_logs(server, monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    j = judge(server.url, api_key_env="JUDGE_KEY")
    assert call(j) == [pytest.approx(0.8)]
    assert SECRET not in repr(j) and "JUDGE_KEY" in repr(j)
    blob = pickle.dumps(j)
    assert SECRET.encode() not in blob
    again = pickle.loads(blob)
    assert call(again) == [pytest.approx(0.8)]
    assert server.requests[-1]["headers"]["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in caplog.text


def test_an_unset_key_variable_is_one_line_naming_it(monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(ValueError, match="LLMJudge.api_key_env='NO_SUCH_KEY_VAR': that environment variable is not set"):
        LLMJudge(base_url="http://x/v1", model="m", prompt="{completion}", api_key_env="NO_SUCH_KEY_VAR")
    with pytest.raises(ValueError, match="the name of an environment variable"):
        LLMJudge(base_url="http://x/v1", model="m", prompt="{completion}", api_key_env="KEY=sk-123")


def test_the_cache_and_duplicates_in_a_batch(server):
    j = judge(server.url, prompt="Rate: {completion}")  # the same request for the same completion
    log = {}
    assert call(j, log=log, completions=["same", "same", "same", "other"]) == [pytest.approx(0.8)] * 4
    assert len(server.requests) == 2 and log["rewards/llm_judge/cache_hits"] == [2.0]
    assert call(j, log=log, completions=["same", "other"]) == [pytest.approx(0.8)] * 2
    assert len(server.requests) == 2 and log["rewards/llm_judge/cache_hits"][-1] == 2.0
    j2 = judge(server.url, prompt="Rate: {completion}", cache_size=0)
    call(j2, completions=["same"])
    call(j2, completions=["same"])
    assert len(server.requests) == 4


def test_failures_are_not_cached(server):
    server.script.extend([("status", 500, {})] * 3)
    j = judge(server.url)
    assert call(j) == [None]
    assert call(j) == [pytest.approx(0.8)]


def test_unparseable_answers_give_none_and_count(server):
    replies = iter(["I cannot tell.", "Score: 11", "7"])
    server.judge_reply = lambda body: next(replies)
    j = judge(server.url)
    log = {}
    assert call(j, n=3, log=log) == [None, None, pytest.approx(0.7)]
    assert log["rewards/llm_judge/parse_failures"] == [2.0] and j.stats["failures"] == 0


def test_labels_and_json_replies(server):
    replies = {"a": "Verdict: not correct", "b": "correct", "c": '```json\n{"verdict": "correct", "score": 3}\n```'}
    server.judge_reply = lambda body: replies[body["messages"][-1]["content"][-1]]
    labels = judge(server.url, prompt="{completion}", labels={"correct": 1.0, "not correct": 0.0})
    assert labels(prompts=["q"] * 2, completions=["a", "b"]) == [0.0, 1.0]
    js = judge(server.url, prompt="{completion}", json_field="score", score_range=[0, 5], normalize=False)
    assert js(prompts=["q"], completions=["c"]) == [3.0]


def test_concurrency_is_bounded(server):
    server.script.extend([("slow", 0.2)] * 6)
    j = judge(server.url, max_concurrency=2)
    assert call(j, n=6) == [pytest.approx(0.8)] * 6
    assert server.max_in_flight == 2


def test_metrics_through_log_metric_and_the_reply_column(server):
    j = judge(server.url, name="helpful")
    log, extra = {}, {}
    out = j(prompts=["q"], completions=["c"], answer=["1"], log_metric=lambda k, v: log.setdefault(k, []).append(v),
            log_extra=lambda k, v: extra.setdefault(k, []).extend(v))
    assert out == [pytest.approx(0.8)]
    assert set(log) == {f"rewards/helpful/{k}" for k in ("requests", "retries", "failures", "cache_hits",
                                                         "parse_failures", "latency_s")}
    assert log["rewards/helpful/latency_s"][0] > 0 and extra == {"helpful_reply": ["Score: 8"]}
    assert j.__name__ == "helpful"


BAD = [
    (dict(prompt="{prompt.__class__}"), "only plain names"),
    (dict(prompt="{completion"), "not a valid template"),
    (dict(prompt=""), "LLMJudge.prompt='' is not allowed"),
    (dict(base_url="localhost:8000"), "LLMJudge.base_url='localhost:8000' is not allowed"),
    (dict(max_retries=-1), r"LLMJudge.max_retries=-1 is not allowed: must be in \[0, 100\]"),
    (dict(timeout_s=0), "LLMJudge.timeout_s=0 is not allowed"),
    (dict(on_failure="retry"), "LLMJudge.on_failure='retry' is not allowed: use one of 'none', 'stop'"),
    (dict(score_range=[5, 1]), "LLMJudge.score_range=\\[5, 1\\] is not allowed"),
    (dict(labels={"yes": "high"}), "LLMJudge.labels="),
    (dict(pattern="Score: \\d+"), "it needs a group"),
    (dict(name="a b"), "LLMJudge.name='a b' is not allowed"),
    (dict(temperature=3), "LLMJudge.temperature=3 is not allowed"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_options_are_one_line(change, message):
    options = dict(base_url="http://127.0.0.1:1/v1", model="m", prompt="{completion}") | change
    with pytest.raises(ValueError, match=message) as info:
        LLMJudge(**options)
    assert "\n" not in str(info.value)


def test_a_missing_column_names_it(server):
    j = judge(server.url, prompt="{completion} vs {reference}")
    with pytest.raises(RewardFunctionError, match="uses \\{reference\\}, and the batch has no column 'reference'"):
        score_completions([j], [None], prompts=["q"], completions=["c"], completion_ids=[[1]], rows=[{"answer": "1"}])
    assert server.requests == []


def test_a_call_that_must_wait_is_bounded(server):
    """Retry-After far beyond max_backoff_s: the wait is capped, the call ends."""
    server.script.extend([("status", 429, {"Retry-After": "3600"})] * 2)
    j = judge(server.url, max_retries=1, max_backoff_s=0.2)
    start = time.monotonic()
    assert call(j) == [None]
    assert time.monotonic() - start < 60  # generous: the cap, not the hour, was waited


def test_a_missing_client_library_names_the_extra(monkeypatch):
    from grpokit.rewards import RemoteRewardModel
    from grpokit.rewards.registry import check_reward_specs

    monkeypatch.setitem(sys.modules, "openai", None)
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(ImportError, match=r"^LLMJudge needs the 'openai' package: pip install 'grpokit\[services\]'$"):
        LLMJudge(base_url="http://x/v1", model="m", prompt="{completion}")
    with pytest.raises(ImportError, match=r"^RemoteRewardModel needs the 'httpx' package"):
        RemoteRewardModel("http://x")
    with pytest.raises(ValueError, match=r"reward_funcs\[0\]: LLMJudge needs the 'openai' package"):
        check_reward_specs([{"LLMJudge": {"base_url": "http://x/v1", "model": "m", "prompt": "{completion}"}}])
