"""CodeExecution: which code runs, which tests, how the score is made, the counts it logs, the sandbox's scrubbed
environment and work directory, and runs in parallel up to ``workers``."""

import os
import threading
import time

import pytest

from grpokit.rewards import CodeExecution, RewardFunctionError, score_completions
from grpokit.rewards import code_execution as code_execution_module
from grpokit.rewards.code_execution import extract_code, split_tests

DOUBLE = "```python\ndef f(x):\n    return 2 * x\n```"
TESTS = ["assert f(2) == 4", "assert f(0) == 0", "assert f(-1) == -2"]


def test_the_last_python_block_is_the_code():
    text = "Try:\n```python\ndef f(x): return 0\n```\nBetter:\n```py\ndef f(x): return 1\n```\n```text\nnot code\n```"
    assert extract_code(text) == "def f(x): return 1\n"
    assert extract_code("```\nprint(1)\n```\nand\n```\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```python\ndef f(x): return 1\n```\n```\nprint(2)\n```") == "def f(x): return 1\n"
    assert extract_code("def f(x): return 1") is None
    assert extract_code("```python\ndef f(x):\n    return 1") is None  # not closed: cut off, not code
    assert extract_code("  ```Python3\nx = 1\n  ```") == "x = 1\n"


def test_tests_as_a_list_or_lines():
    assert split_tests(["assert f(1) == 2", " "]) == ["assert f(1) == 2"]
    assert split_tests("assert f(1) == 2\n\n# a comment\nassert f(2) == 4\n") == ["assert f(1) == 2", "assert f(2) == 4"]
    assert split_tests(None) is None and split_tests([]) is None and split_tests("# nothing") is None
    with pytest.raises(ValueError, match="a tests value must be a list of Python statements"):
        split_tests(5)


def test_scores_share_or_all_of_the_tests():
    half = "```python\ndef f(x):\n    return 2 * x if x else 1\n```"
    reward = CodeExecution(timeout_s=10)
    log = {}
    out = reward(completions=[DOUBLE, half, "no code", DOUBLE], tests=[TESTS, TESTS, TESTS, None],
                 log_metric=lambda k, v: log.setdefault(k, []).append(v))
    assert out == [1.0, pytest.approx(2 / 3), 0.0, None]
    assert log["rewards/code_execution/runs"] == [2.0] and log["rewards/code_execution/no_code"] == [1.0]
    assert log["rewards/code_execution/failures"] == [0.0] and "rewards/code_execution/run_s" in log
    strict = CodeExecution(score="all", name="strict")
    assert strict(completions=[DOUBLE, half], tests=[TESTS, TESTS]) == [1.0, 0.0]
    assert strict.stats == {"runs": 2, "no_code": 0, "failures": 0, "error": 0, "memory": 0, "timeout": 0,
                            "output_limit": 0, "crash": 0, "sandbox_error": 0}


def test_chat_completions_and_a_run_that_ends_early_keeps_its_passes():
    code = "```python\ndef f(x):\n    while x == 0:\n        pass\n    return 2 * x\n```"
    reward = CodeExecution(timeout_s=1.5)
    out = reward(prompts=[[{"role": "user", "content": "q"}]],
                 completions=[[{"role": "assistant", "content": code}]], tests=[TESTS[:1] + TESTS[1:2] + TESTS[2:]])
    assert out == [pytest.approx(1 / 3)]  # f(2) passed; f(0) never returned
    assert reward.stats["timeout"] == 1 and reward.stats["failures"] == 1


def test_the_environment_and_work_directory_of_a_run(monkeypatch):
    monkeypatch.setenv("GRPOKIT_TRAINER_ONLY", "should-not-be-seen")
    reward = CodeExecution()
    code = ("import os, tempfile\nprint(sorted(os.environ))\nprint(os.getcwd(), os.listdir('.'))\n"
            "open('out.txt', 'w').write('x' * 100)\nprint(tempfile.mkstemp()[1])\n")
    result = reward.run(code, ["assert open('out.txt').read() == 'x' * 100"])
    assert result.status == "ok" and result.passed == 1, result
    env_line, cwd_line, temp_line = result.stdout.splitlines()
    assert env_line == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']"
    cwd = cwd_line.split()[0]
    assert os.path.basename(cwd).startswith("grpokit-sandbox-") and cwd_line.endswith("[]")
    assert temp_line.startswith(cwd)
    assert not os.path.exists(cwd)  # removed after the run


def test_a_missing_tests_column_names_it():
    with pytest.raises(RewardFunctionError, match="needs a dataset column 'tests'"):
        score_completions([CodeExecution()], [None], prompts=["p"], completions=[DOUBLE], completion_ids=[[1]],
                          rows=[{"answer": "1"}])


def test_runs_in_parallel_up_to_workers(monkeypatch):
    spans, lock = [], threading.Lock()
    real = code_execution_module.run_sandboxed

    def timed(*args, **kwargs):
        start = time.monotonic()
        result = real(*args, **kwargs)
        with lock:
            spans.append((start, time.monotonic()))
        return result

    monkeypatch.setattr(code_execution_module, "run_sandboxed", timed)
    slow = "```python\nimport time\ntime.sleep(0.5)\ndef f(x):\n    return 2 * x\n```"
    reward = CodeExecution(workers=2)
    assert reward(completions=[slow] * 4, tests=[TESTS] * 4) == [1.0] * 4
    assert max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans) == 2


def test_concurrent_runs_never_share_a_slot():
    """Two rewards (or threads) running at once each get a worker slot, so a uid, of their own."""
    from grpokit.rewards.sandbox import SlotPool

    pool, held, lock, clashes = SlotPool(size=3), set(), threading.Lock(), []

    def worker():
        for _ in range(200):
            slot = pool.acquire()
            with lock:
                clashes.append(slot in held)
                held.add(slot)
            time.sleep(0.0005)
            with lock:
                held.discard(slot)
            pool.release(slot)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(clashes) == 1200 and not any(clashes)
    assert [pool.acquire() for _ in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("change,message", [
    (dict(score="half"), "CodeExecution.score='half' is not allowed"),
    (dict(timeout_s=0), "CodeExecution.timeout_s=0 is not allowed"),
    (dict(memory_mb=1.5), "CodeExecution.memory_mb=1.5 is not allowed"),
    (dict(workers=0), "CodeExecution.workers=0 is not allowed"),
    (dict(python="/no/such/python"), "CodeExecution.python='/no/such/python' is not allowed"),
    (dict(workdir_root="/no/such/dir"), "CodeExecution.workdir_root='/no/such/dir' is not allowed"),
    (dict(name=""), "CodeExecution.name='' is not allowed"),
])
def test_bad_options(change, message):
    with pytest.raises(ValueError, match=message):
        CodeExecution(**change)


def test_require_isolation_refuses_a_weak_sandbox(monkeypatch, caplog):
    import sys

    from grpokit.rewards.sandbox import Isolation

    weak = Isolation(sys.executable, None)  # same uid as the trainer, no namespace
    monkeypatch.setattr(code_execution_module, "detect_isolation", lambda *a: weak)
    with pytest.raises(RuntimeError, match="require_isolation is set and this machine's sandbox lacks: network access"):
        CodeExecution(require_isolation=True)(completions=[DOUBLE], tests=[TESTS])
    assert CodeExecution().isolation is weak
    assert "the sandbox here does not prevent network access" in caplog.text
