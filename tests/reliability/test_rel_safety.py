"""Nothing unsafe runs: no remote code unless asked, weights from safetensors, ``torch.load`` only with
``weights_only=True`` (transformers 5's resume path included), and no model output is ever executed."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from reliability_helpers import make_trainer

import grpokit
import grpokit.models
from grpokit.config import GRPOConfig

PACKAGE = Path(grpokit.__file__).resolve().parent


def test_trust_remote_code_is_off_by_default(tmp_path, monkeypatch):
    assert GRPOConfig(output_dir=str(tmp_path)).trust_remote_code is False
    seen = []

    def capture(name_or_path, *a, **k):
        seen.append((name_or_path, k))
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", capture)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", capture)
    for loader in (grpokit.models.load_model, grpokit.models.load_tokenizer):
        with pytest.raises(OSError):
            loader(str(tmp_path))
    model_kwargs, tok_kwargs = seen[0][1], seen[1][1]
    assert model_kwargs["trust_remote_code"] is False and model_kwargs["use_safetensors"] is True
    assert tok_kwargs["trust_remote_code"] is False


def test_the_job_asks_for_no_remote_code(tmp_path, monkeypatch):
    from grpokit.cli import main

    seen = []

    def tokenizer(name, **k):
        seen.append(("tokenizer", k))
        return types.SimpleNamespace(chat_template=None)

    def model(name, **k):
        seen.append(("model", k))
        raise OSError("stop here")

    def config(name, **k):  # the vision-model check reads the config first
        seen.append(("config", k))
        raise OSError("not on disk")

    monkeypatch.setattr(grpokit.models, "load_tokenizer", tokenizer)
    monkeypatch.setattr(grpokit.models, "load_model", model)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", config)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "some/model", "task": "arithmetic", "output_dir": str(tmp_path / "o"),
                                   "per_device_train_batch_size": 4, "num_generations": 4}))
    assert main(["train", str(cfg)]) == 2
    assert seen == [("config", {"trust_remote_code": False}), ("tokenizer", {"trust_remote_code": False}),
                    ("model", {"trust_remote_code": False})]


def test_resume_reads_torch_files_only_with_weights_only(tmp_path, monkeypatch):
    """transformers 5.24 loads optimizer.pt, scheduler.pt and rng_state.pth with torch.load(weights_only=True) and
    the weights with safetensors; checked here on a real resume."""
    out = tmp_path / "out"
    make_trainer(out, max_steps=1, save_strategy="steps", save_steps=1).train()
    calls = []
    original = torch.load

    def recording_load(*a, **k):
        calls.append((str(a[0]) if a else str(k.get("f")), k.get("weights_only")))
        return original(*a, **k)

    monkeypatch.setattr(torch, "load", recording_load)
    trainer = make_trainer(out, max_steps=2)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    names = {Path(f).name for f, _ in calls}
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth"} <= names
    assert all(w is True for _, w in calls), calls
    assert not any(n.endswith(".bin") for n in names)


def test_reward_models_load_from_safetensors_without_remote_code(monkeypatch):
    from grpokit.rewards import resolve_reward_funcs

    seen = {}

    def capture(spec, **k):
        seen.update(k)
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", capture)
    with pytest.raises(OSError):
        resolve_reward_funcs("org/reward-model")
    assert seen["use_safetensors"] is True and seen["trust_remote_code"] is False


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else (
                f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None)
            yield node, name


SANDBOX_EXCEPTIONS = {"grpokit/rewards/sandbox.py: import subprocess", "grpokit/rewards/sandbox_child.py: exec(",
                      "grpokit/rewards/sandbox_child.py: compile("}
"""The one place model-written code runs, on purpose: CodeExecution starts a sandboxed child process (sandbox.py,
argument lists only, never a shell) and the child executes the completion and its tests (docs/rewards.md)."""
REWARD_PROCESS_EXCEPTIONS = {"grpokit/rewards/process.py: import subprocess", "grpokit/rewards/process.py: import dill",
                             "grpokit/rewards/process_child.py: import dill"}
"""The reward process (reward_process=True): the user's own reward functions, pickled by the trainer, unpickled by
the child it started (an argument list, never a shell), which answers over a private pipe with what those functions
returned. Nothing read from a file, the network or a model's output is unpickled: both ends hold only what the
user's code already is or made, with the trust it has in the trainer's process."""

ROLLOUT_WORKER_EXCEPTIONS = {"grpokit/pipeline/workers/pool.py: import subprocess",
                             "grpokit/pipeline/workers/pool.py: import dill",
                             "grpokit/pipeline/workers/shared.py: import dill",
                             "grpokit/pipeline/workers/crossing.py: import dill",
                             "grpokit/pipeline/workers/crossing.py: import pickle"}
"""Rollout workers (rollout_workers > 0): the trainer pickles its own sampling half (the user's reward functions,
tools, its dataset and policy) for the worker processes it starts (an argument list, never a shell); a worker
unpickles that over a private pipe, and the trainer unpickles the batches its own workers send back on theirs.
``crossing.py`` only pickles (to check what can cross; ``pickle`` for its error type). Nothing read from a file, the
network or a model's output is unpickled: a worker runs the user's code with the trust it has in the trainer's
process."""

VLLM_SERVER_EXCEPTIONS = {"grpokit/rollout/vllm_launch.py: import subprocess",
                          "grpokit/rollout/fp8_kernel.py: import subprocess"}
"""``grpokit vllm-serve`` starts vLLM's own server: an argument list (the configured Python, ``-m
vllm.entrypoints.openai.api_server`` and flags), never a shell; nothing it reads is executed. Before serving int8,
``fp8_kernel.py`` runs the same Python on grpokit's own fixed probe (``-c`` and a constant script, an argument list)
and only reads the kernel's name from oneDNN's log."""


def test_the_package_executes_nothing_it_reads():
    """No eval/exec/compile, no shell, no pickle; torch.load only with weights_only=True; YAML only through a
    SafeLoader; imports by name only from the user's config (reward 'module:function' specs). The sandbox's two files
    are the exception (SANDBOX_EXCEPTIONS), and only for what they are there for."""
    banned_calls = {"eval", "exec", "compile", "__import__", "os.system", "os.popen", "pickle.load", "pickle.loads",
                    "marshal.loads", "yaml.unsafe_load", "yaml.full_load"}
    banned_imports = {"pickle", "dill", "cloudpickle", "marshal", "subprocess", "shelve"}
    problems = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [f"{path}: import {a.name}" for a in node.names if a.name.split(".")[0] in banned_imports]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in banned_imports:
                problems.append(f"{path}: from {node.module} import")
        for node, name in _calls(tree):
            if name in banned_calls:
                problems.append(f"{path}:{node.lineno}: {name}(")
            if name == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    problems.append(f"{path}:{node.lineno}: torch.load without weights_only=True")
            if name == "yaml.load" and not any(k.arg == "Loader" for k in node.keywords):
                problems.append(f"{path}:{node.lineno}: yaml.load without a Loader (the one used is checked below)")
    relative = [p.replace(str(PACKAGE.parent) + "/", "") for p in problems]
    allowed = SANDBOX_EXCEPTIONS | REWARD_PROCESS_EXCEPTIONS | ROLLOUT_WORKER_EXCEPTIONS | VLLM_SERVER_EXCEPTIONS
    assert {re.sub(r":\d+:", ":", p) for p in relative} <= allowed, relative
    shell = [f"{path}:{node.lineno}" for path in files for node, name in _calls(ast.parse(path.read_text()))
             if name and name.startswith("subprocess.") and any(k.arg == "shell" for k in node.keywords)]
    assert shell == []


def test_the_yaml_loader_is_a_safe_loader():
    import yaml as _yaml

    from grpokit.cli import _unique_key_loader

    assert issubclass(_unique_key_loader(), _yaml.SafeLoader)


@pytest.mark.parametrize("completion", [
    "__import__('os').system('touch PWNED')",
    "Answer: __import__('os').system('touch PWNED')",
    "Answer: exec(\"open('PWNED','w')\")",
    "Answer: (lambda: open('PWNED', 'w'))()",
    "Answer: 9**9**9**9",
    "Answer: " + "(" * 5000,
])
def test_model_output_is_never_executed_by_the_rewards(tmp_path, monkeypatch, completion):
    from grpokit.rewards import REWARD_FUNCS

    monkeypatch.chdir(tmp_path)
    for name, func in REWARD_FUNCS.items():
        values = func(prompts=["q"], completions=[completion], answer=["4"], target_words=[3])
        assert len(values) == 1 and (values[0] is None or isinstance(values[0], float)), name
    assert not (tmp_path / "PWNED").exists()


def test_saved_models_are_safetensors(tmp_path):
    trainer = make_trainer(tmp_path / "out", max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    names = {p.name for p in (tmp_path / "final").iterdir()}
    assert "model.safetensors" in names and not any(n.endswith((".bin", ".pt", ".pkl")) for n in names - {
        "training_args.bin"})
    # training_args.bin is transformers' pickled TrainingArguments: written for transformers' tools, never read
    # by grpokit (a resume reads trainer_state.json)
