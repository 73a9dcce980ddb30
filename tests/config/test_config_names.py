"""The names a job spec's keys are checked against: GRPOConfig's own fields, cached per transformers version and
grpokit source so that a later job reports a typo without importing transformers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import grpokit.config_names as config_names
from grpokit.config import GRPOConfig
from grpokit.config_names import config_field_names


def test_the_names_are_grpoconfig_s_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path))
    expected = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    assert "vespo_k_pos" in expected and "learning_rate" in expected  # a loss's own field and a transformers one
    assert config_field_names() == expected
    (cached,) = tmp_path.glob("config-fields-*.json")
    assert set(json.loads(cached.read_text())) == expected
    cached.write_text(json.dumps(["only_this"]))  # the cache is what is read when it matches
    assert config_field_names() == {"only_this"}
    cached.write_text("{not json")  # a damaged cache is read past
    assert config_field_names() == expected


def test_another_transformers_or_source_is_another_cache(monkeypatch):
    key = config_names.source_key()
    monkeypatch.setattr(config_names.importlib.metadata, "version", lambda name: "0.0.1")
    assert config_names.source_key() != key


def test_a_second_job_checks_its_keys_without_importing_transformers(tmp_path):
    code = ("import sys; from grpokit.run.job_spec import split_spec\n"
            "try:\n    split_spec({'model': 'x', 'task': 'arithmetic', 'learnig_rate': 1})\n"
            "except ValueError as e:\n    print(e)\n"
            "print('transformers' in sys.modules)")
    env = {"GRPOKIT_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
            for _ in range(2)]
    for run in runs:
        assert "unknown config key 'learnig_rate'; did you mean learning_rate?" in run.stdout, run.stderr
    assert runs[0].stdout.strip().endswith("True") and runs[1].stdout.strip().endswith("False")


def test_an_unwritable_cache_is_ignored(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GRPOKIT_CACHE", str(blocker / "sub"))  # a directory under a file: cannot be made
    assert "learning_rate" in config_field_names()
