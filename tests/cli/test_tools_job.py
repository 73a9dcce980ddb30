"""`grpokit train` with tools and environments named in the YAML (module:function, file.py:Class), the chat
template chosen there, and one-line errors for what cannot be imported or described."""

import json

import pytest
import yaml

from grpokit.cli import main

USER_CODE = '''
def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    return key.upper()


class Notebook:
    def reset(self, **row):
        self.notes = []

    def write(self, text: str) -> int:
        """Write a note.

        Args:
            text: the note
        """
        self.notes.append(text)
        return len(self.notes)

    def get_reward(self) -> float:
        return float(len(self.notes))


def undocumented(x):
    return x
'''


def spec_for(tiny_dir, tmp_path, **extra):
    (tmp_path / "usercode.py").write_text(USER_CODE)
    base = {
        "model": str(tiny_dir), "task": "arithmetic", "output_dir": str(tmp_path / "run"),
        "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8, "max_steps": 1,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "gradient_checkpointing": False,
        "use_cpu": True, "eval": {"n": 4, "max_new_tokens": 8}, "chat_template": "chatml-tools",
        "tools": [f"{tmp_path / 'usercode.py'}:lookup"], "environment": f"{tmp_path / 'usercode.py'}:Notebook",
    }
    return base | extra


def write(tmp_path, spec):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_a_job_with_tools_and_an_environment(tmp_path, tiny_dir):
    assert main(["train", write(tmp_path, spec_for(tiny_dir, tmp_path)), "--quiet"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [x for x in lines if "reward" in x][0]
    assert "tools/call_frequency" in step and "rewards/Notebook/mean" in step
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert {"tool_calls_per_row", "tool_failure_rate"} <= set(report["eval_after"])
    assert "Notebook" in report["eval_after"]["rewards"]


BAD = [
    ({"tools": ["nomodule_xyz:fn"]}, "tools='nomodule_xyz:fn': cannot import module 'nomodule_xyz'"),
    ({"tools": ["justaname"]}, "tools='justaname' is not allowed: expected 'package.module:name'"),
    ({"tools": "USER:missing"}, "has no attribute 'missing'"),
    ({"tools": "USER:undocumented"}, "tool 'undocumented' cannot be described to the model"),
    ({"environment": 5}, "environment=5 is not allowed"),
    ({"environment": {"a": "USER:lookup"}}, "environment_factory['a'] could not make an environment"),
    ({"environment": "collections:OrderedDict"}, "makes OrderedDict, which has no reset(**row) method"),
    ({"chat_template": "nofile.jinja"}, "chat_template='nofile.jinja' is not allowed"),
    ({"chat_template": 5}, "chat_template=5 is not allowed"),
    ({"chat_template": None}, "does not render tool calls"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_tool_settings_are_one_line(tmp_path, tiny_dir, capsys, override, message):
    user = str(tmp_path / "usercode.py")
    override = json.loads(json.dumps(override).replace("USER", user))
    spec = spec_for(tiny_dir, tmp_path) | override
    if spec["chat_template"] is None:
        del spec["chat_template"]
    assert main(["train", write(tmp_path, spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpokit: error:") and message in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1
