"""Scoring services from a YAML job: the built-in coding task with CodeExecution, reward classes named with their
options in ``reward_funcs``, their metrics in metrics.jsonl, one-line errors checked before torch is imported, and an
API key that reaches the judge's server and no file the run writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from service_servers import FaultServer

from grpokit.cli import main

SECRET = "sk-live-7f3c9e21b5d84a06-do-not-write"


def spec_for(tiny_dir, tmp_path, **extra):
    base = {
        "model": str(tiny_dir), "task": "coding", "output_dir": str(tmp_path / "run"),
        "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8, "max_steps": 1,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "gradient_checkpointing": False,
        "use_cpu": True, "eval": {"n": 4, "max_new_tokens": 8},
    }
    return base | extra


def write(tmp_path, spec):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def metric_lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_coding_task_end_to_end(tmp_path, tiny_dir):
    assert main(["train", write(tmp_path, spec_for(tiny_dir, tmp_path)), "--quiet"]) == 0
    step = [x for x in metric_lines(tmp_path / "run") if "reward" in x][0]
    assert "rewards/code_execution/mean" in step
    assert step["rewards/code_execution/runs"] + step["rewards/code_execution/no_code"] == 4  # 2 prompts x 2
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["eval_after"]["n"] == 4 and "accuracy" in report["eval_after"]
    assert report["extra"]["task"] == "coding"


def test_reward_classes_in_yaml(tmp_path, tiny_dir, monkeypatch, capsys):
    """An LLM judge (its key in the environment) and CodeExecution with options, named in reward_funcs; the key goes
    to the server and into no file of the run, checkpoints included, nor the terminal."""
    monkeypatch.setenv("GRPOKIT_JUDGE_KEY", SECRET)
    with FaultServer() as server:
        server.script.extend([("status", 429, {"Retry-After": "0"}), ("status", 500, {})])
        spec = spec_for(tiny_dir, tmp_path, save_strategy="steps", save_steps=1, reward_funcs=[
            {"CodeExecution": {"timeout_s": 3, "name": "unit_tests", "score": "all"}},
            {"LLMJudge": {"base_url": server.url + "/v1", "model": "judge", "api_key_env": "GRPOKIT_JUDGE_KEY",
                          "prompt": "Task: {prompt}\nReply: {completion}\nScore 0-10.", "backoff_s": 0.01,
                          "max_concurrency": 2}},
        ])
        assert main(["train", write(tmp_path, spec)]) == 0
    assert server.requests and all(r["headers"]["authorization"] == f"Bearer {SECRET}" for r in server.requests)
    step = [x for x in metric_lines(tmp_path / "run") if "reward" in x][0]
    assert step["rewards/llm_judge/mean"] == pytest.approx(0.8)
    assert {"rewards/llm_judge/retries", "rewards/llm_judge/failures", "rewards/llm_judge/latency_s"} <= set(step)
    bodies = [json.dumps(r["body"], sort_keys=True) for r in server.requests]
    assert len(bodies) == len(set(bodies)) + 2  # each request sent once (then cached), the 429 and the 500 retried
    assert "rewards/unit_tests/mean" in step and "rewards/unit_tests/no_code" in step
    printed = capsys.readouterr()
    assert SECRET not in printed.out + printed.err
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any("checkpoint-1" in str(p) for p in files)
    leaked = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaked, f"the key was written into {leaked}"


BAD = [
    ({"reward_funcs": [{"LLMJudg": {}}]}, "reward_funcs[0]: reward_funcs entry {LLMJudg: ...}: unknown reward class; "
                                          "did you mean LLMJudge?"),
    ({"reward_funcs": [{"CodeExecution": {"timeout": 3}}]}, "CodeExecution has no option 'timeout'; did you mean "
                                                             "timeout_s?"),
    ({"reward_funcs": [{"CodeExecution": {"timeout_s": -1}}]}, "CodeExecution.timeout_s=-1 is not allowed"),
    ({"reward_funcs": {"LLMJudge": {"model": "m"}}}, "LLMJudge needs base_url, prompt"),
    ({"reward_funcs": [{"LLMJudge": {"base_url": "http://x/v1", "model": "m", "prompt": "{completion}",
                                     "api_key_env": "GRPOKIT_UNSET_KEY_VAR"}}]},
     "LLMJudge.api_key_env='GRPOKIT_UNSET_KEY_VAR': that environment variable is not set"),
    ({"reward_funcs": [{"RemoteRewardModel": {"base_url": "http://x", "api": "grpc"}}]},
     "RemoteRewardModel.api='grpc' is not allowed"),
    ({"reward_funcs": [{"CodeExecution": {}, "LLMJudge": {}}]}, "names one class with its arguments"),
    ({"reward_funcs": [5]}, "reward_funcs=[5] is not allowed"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[str(b[1])[:40] for b in BAD])
def test_bad_reward_entries_are_one_line(tmp_path, tiny_dir, capsys, monkeypatch, override, message):
    monkeypatch.delenv("GRPOKIT_UNSET_KEY_VAR", raising=False)
    assert main(["train", write(tmp_path, spec_for(tiny_dir, tmp_path) | override)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpokit: error:") and message in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_reward_entries_are_checked_without_torch(tmp_path):
    code = ("import sys\nfrom grpokit.run.job_spec import JobError, split_spec\n"
            "ok = {'model': 'm', 'task': 'coding', 'reward_funcs': [{'CodeExecution': {'timeout_s': 2}},"
            " {'LLMJudge': {'base_url': 'http://127.0.0.1:9/v1', 'model': 'j', 'prompt': '{completion}'}},"
            " {'RemoteRewardModel': {'base_url': 'http://127.0.0.1:9'}}, 'correctness']}\n"
            "split_spec(ok)\n"
            "try:\n    split_spec(dict(ok, reward_funcs=[{'CodeExecution': {'workers': 0}}]))\n"
            "except JobError as e:\n    print(e)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["reward_funcs[0]: CodeExecution.workers=0 is not allowed: expected a positive "
                                       "integer or None", "False False"]


def test_reward_classes_from_python_by_mapping():
    from grpokit.rewards import CodeExecution, resolve_reward_funcs

    (reward,) = resolve_reward_funcs([{"CodeExecution": {"name": "tests_pass"}}])
    assert isinstance(reward, CodeExecution) and reward.__name__ == "tests_pass"
