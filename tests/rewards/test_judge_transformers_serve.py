"""LLMJudge against a real OpenAI-compatible server: ``transformers serve`` with a tiny random-weight model, started
by the test. The request/response path works end to end; the random model's replies are read by the documented
rule (mostly unparseable: ``None`` and a counted parse failure)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from service_servers import closed_port

from grpokit.rewards import LLMJudge
from grpokit.rewards.judge_parsing import parse_score

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    port = closed_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([cli, "serve", str(tiny_dir), "--host", "127.0.0.1", "--port", str(port),
                                 "--device", "cpu", "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"transformers serve did not start (exit status {proc.poll()}): "
                            f"{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_judge_on_transformers_serve(served, tiny_dir):
    judge = LLMJudge(base_url=served, model=str(tiny_dir), prompt="Rate this reply from 0 to 10: {completion}",
                     max_tokens=8, timeout_s=60, max_retries=1, max_concurrency=2)
    replies, log = {}, {}
    completions = ["The answer is 4.", "I do not know.", "The answer is 4."]
    scores = judge(prompts=["2+2?"] * 3, completions=completions,
                   log_extra=lambda k, v: replies.setdefault(k, []).extend(v),
                   log_metric=lambda k, v: log.setdefault(k, []).append(v))
    texts = replies["llm_judge_reply"]
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)  # every request was answered
    assert scores == [parse_score(t, judge.rule) for t in texts]  # the documented rule, reply by reply
    assert log["rewards/llm_judge/failures"] == [0.0] and log["rewards/llm_judge/requests"] == [2.0]
    assert log["rewards/llm_judge/cache_hits"] == [1.0]
    assert log["rewards/llm_judge/parse_failures"] == [float(sum(s is None for s in scores))]
