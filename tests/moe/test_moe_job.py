"""``grpokit train`` on a saved tiny Mixture-of-Experts model with ``routing_replay`` in the YAML: the router metrics
reach ``metrics.jsonl`` and the report."""

from __future__ import annotations

import json

import yaml
from tiny import tiny_tokenizer
from tiny_moe import tiny_moe_model

from grpokit.cli import main


def test_a_moe_job_reports_its_routing(tmp_path, capsys):
    model_dir, out = tmp_path / "moe", tmp_path / "run"
    tok = tiny_tokenizer()
    tiny_moe_model("qwen3_moe", tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    spec = {"model": str(model_dir), "task": "arithmetic", "output_dir": str(out), "per_device_train_batch_size": 4,
            "num_generations": 4, "max_completion_length": 8, "max_steps": 2, "logging_steps": 1,
            "save_strategy": "no", "report_to": "none", "gradient_checkpointing": False, "use_cpu": True,
            "routing_replay": "rollout", "steps_per_generation": 2, "eval": {"n": 4, "max_new_tokens": 8}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert main(["train", str(tmp_path / "job.yaml"), "--quiet"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "moe/load_imbalance" in x]
    assert len(trained) == 2 and all("moe/rerouted_share" in x for x in trained)
    report = (out / "report.md").read_text()
    assert "## Mixture-of-Experts routing" in report and "expert load imbalance" in report
    assert json.loads((out / "report.json").read_text())["config"]["routing_replay"] == "rollout"
