"""SIGINT / SIGTERM during training: a checkpoint at the next step boundary, a clean stop, and a resume that ends
exactly where an uninterrupted run with the same seed ends (bit for bit: tolerance 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hang import HANG_S
from reliability_helpers import chat_dataset, make_trainer
from runs import params_of
from transformers import TrainerCallback

from grpokit.callbacks import GracefulInterrupt
from grpokit.run.checkpoints import verify_checkpoint
from grpokit.run.run_dir import latest_checkpoint

TESTS = Path(__file__).resolve().parent


class SendSignal(TrainerCallback):
    """Deliver real signals to this process at the start of optimizer step ``at`` (1-based): the handler runs
    while that step is in progress, as it would for a Ctrl-C typed at that moment."""

    def __init__(self, at: int, sig: int, times: int = 1):
        self.at, self.sig, self.times = at, sig, times

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)


def logs_after(trainer, step: int) -> dict[int, tuple]:
    """(loss, reward) logged at each step after ``step``; reward is None on steps that reuse rollouts."""
    return {h["step"]: (h["loss"], h.get("reward")) for h in trainer.state.log_history
            if "loss" in h and "train_loss" not in h and h["step"] > step}


# (id, trainer settings, stop after step, total steps). The last three stop inside a generation batch: the
# rollouts not yet consumed travel in the checkpoint.
SCHEDULES = [
    ("ga1", dict(), 2, 4),
    ("ga2", dict(gradient_accumulation_steps=2, per_device_train_batch_size=2), 2, 4),
    ("epoch_boundary", dict(per_device_train_batch_size=8, dataset=chat_dataset(8)), 4, 6),  # 4 steps an epoch
    ("mid_generation_steps_per_gen", dict(steps_per_generation=2), 1, 4),
    ("mid_generation_num_iterations", dict(num_iterations=2, loss_type="grpo", epsilon=0.05), 3, 4),
    # the weight average travels in the checkpoint; the interrupted run keeps its trained weights, and the resumed
    # one ends with the same average as the uninterrupted run
    ("ema_decay", dict(ema_decay=0.8), 2, 4),
]


_FULL_RUNS: dict[str, tuple] = {}


@pytest.fixture(autouse=True)
def usual_signal_handlers():
    """Python's own SIGINT/SIGTERM handlers for each test, whatever started pytest left (a background job of a
    non-interactive shell inherits SIGINT ignored, which grpokit then rightly leaves alone)."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("name,settings,stop,total", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_interrupt_then_resume_equals_an_uninterrupted_run(tmp_path, sig, name, settings, stop, total):
    common = dict(settings, max_steps=total, learning_rate=0.05, save_strategy="no")
    original = signal.getsignal(sig)

    if name not in _FULL_RUNS:  # the uninterrupted reference, shared by both signals
        full = make_trainer(tmp_path / "full", **common)
        full.train()
        assert full.interrupted is None and full.state.global_step == total
        _FULL_RUNS[name] = (params_of(full.model), logs_after(full, stop))
    final_full, after = _FULL_RUNS[name]

    first = make_trainer(tmp_path / "run", **common)
    first.add_callback(SendSignal(stop, sig))
    first.train()
    assert first.interrupted == sig and first.state.global_step == stop  # stopped at the next step boundary
    assert signal.getsignal(sig) == original  # handlers restored
    ckpt = Path(first.interrupt_checkpoint)
    assert ckpt.name == f"checkpoint-{stop}" and verify_checkpoint(ckpt) == stop
    assert latest_checkpoint(tmp_path / "run") == ckpt

    resumed = make_trainer(tmp_path / "run", model_seed=123, **common)  # other initial weights: all come from ckpt
    resumed.train(resume_from_checkpoint="auto")
    assert resumed.state.global_step == total and resumed.interrupted is None
    final_resumed = params_of(resumed.model)
    for n in final_full:
        assert torch.equal(final_full[n], final_resumed[n]), n  # tolerance 0: bit for bit
    assert len(after) == total - stop and logs_after(resumed, stop) == after  # the same losses and rollouts


def test_second_sigint_stops_at_once(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=3, save_strategy="no")
    trainer.add_callback(SendSignal(2, signal.SIGINT, times=2))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == 1  # step 2 was not finished and no checkpoint was written
    assert latest_checkpoint(tmp_path) is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_no_handlers_outside_train_and_ignored_signals_stay_ignored(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    seen = {}

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            seen["int"] = signal.getsignal(signal.SIGINT)
            seen["term"] = signal.getsignal(signal.SIGTERM)

    trainer.add_callback(Probe())
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        trainer.train()
    finally:
        signal.signal(signal.SIGTERM, previous)
    guard = next(c for c in trainer.callback_handler.callbacks if isinstance(c, GracefulInterrupt))
    assert getattr(seen["int"], "__self__", None) is guard and seen["term"] == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# -- the command line, in a child process ------------------------------------------------------------------------
def wait_for(predicate, timeout: float, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return predicate()
        time.sleep(0.05)
    return False


def metric_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def cli(args: list[str], tmp_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen([sys.executable, "-m", "grpokit.cli", "train", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_sigterm_saves_exits_143_and_resume_finishes(tmp_path, tiny_dir):
    out = tmp_path / "run"
    spec = {
        "model": str(tiny_dir), "task": "arithmetic", "output_dir": str(out), "per_device_train_batch_size": 4,
        "num_generations": 4, "max_completion_length": 8, "max_steps": 12, "logging_steps": 1,
        "save_strategy": "no", "report_to": "none", "gradient_checkpointing": False, "use_cpu": True,
        "learning_rate": 1e-3, "reward_funcs": ["reliability_cli_rewards:correctness", "format"],
        "eval": {"n": 4, "max_new_tokens": 8},
    }
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(spec))

    proc = cli([str(cfg), "--quiet"], tmp_path)
    try:
        assert wait_for(lambda: 2 in metric_steps(out), HANG_S, proc), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "grpokit: interrupted by SIGTERM at step" in err and "--resume" in err and "Traceback" not in err
    ckpt = latest_checkpoint(out)
    stopped = verify_checkpoint(ckpt)
    assert 2 <= stopped < 12 and f"checkpoint saved to {ckpt}" in err
    assert not (out / "report.json").exists()

    proc = cli([str(cfg), "--quiet", "--resume"], tmp_path)
    stdout, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err
    assert f"resuming from {ckpt}" in stdout and "before (measured by the first run)" in stdout
    steps = metric_steps(out)
    assert set(range(1, 13)) <= set(steps)  # every step logged once across the two processes
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["steps"] == 12
