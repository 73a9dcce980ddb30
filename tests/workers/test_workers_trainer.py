"""Rollout workers through GRPOTrainer (rollout_workers > 0): the prompts trained are those of the synchronous order,
behaviour log-probs are the published weights' own (full and LoRA), a killed worker is restarted and its rows sampled
again, a stopped run resumes on the prompts of an uninterrupted one, start failures and stalls are one line, and no
worker process is left behind on any exit path."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import torch
from datasets import Dataset
from runs import run_args
from tiny import tiny_model, tiny_tokenizer
from transformers import TrainerCallback

from grpokit.pipeline.workers import RolloutWorkerError
from grpokit.pipeline.workers.weights import WeightSlots
from grpokit.trainer import GRPOTrainer


def dataset(n=48):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
                              "hard": [i % 3 != 0 for i in range(n)]})


def chars(completions, **kw):
    return [len(set(c[0]["content"])) / 8 for c in completions]


def spread_if_easy(completions, hard, **kw):
    """Depends on the prompt only: which groups have spread is the same in every run."""
    return [0.0 if h else float(i % 2) for i, h in enumerate(hard)]


def worker_children() -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and " ".join(p.cmdline()).endswith("-m grpokit.pipeline.workers"):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def make(out, reward=chars, callbacks=(), model=None, **kw):
    tok = tiny_tokenizer()
    args = run_args(out, **{"max_completion_length": 6, "max_steps": 4, "learning_rate": 5e-2, **kw})
    return GRPOTrainer(model or tiny_model(tok), reward, args=args, train_dataset=dataset(), processing_class=tok,
                       callbacks=list(callbacks))


def record_trained(trainer) -> list:
    """The prompts of every training batch the learner finishes (the first of each group)."""
    trained = []
    finish = trainer.pipeline.finish

    def record(samples, stats, driver, mode="train", **kw):
        if mode == "train":
            trained.append([p[0]["content"] for p in samples.prompts[::4]])
        return finish(samples, stats, driver, mode, **kw)

    trainer.pipeline.finish = record
    return trained


@pytest.fixture(autouse=True)
def python_signal_handlers():
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    yield
    for s, h in previous.items():
        signal.signal(s, h)


def test_two_workers_train_on_the_synchronous_order_and_every_parameter_moves(tmp_path):
    sync = make(tmp_path / "sync")
    seen = record_trained(sync)
    sync.train()
    model = tiny_model(tiny_tokenizer())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    t = make(tmp_path / "workers", model=model, rollout_workers=2, max_staleness=1)
    trained = record_trained(t)
    t.train()
    assert trained == seen  # batch k's rows are the dataloader's, whichever worker made it
    logs = [h for h in t.state.log_history if "reward" in h]
    assert len(logs) == 4 and all(h["sample/staleness_max"] <= 1 for h in logs)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "a parameter did not move"
    assert t.pipeline.producer is None and not worker_children()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_behaviour_logps_are_the_published_weights_own(tmp_path, lora, monkeypatch):
    """Every batch's behaviour log-probs, computed by the worker with the weights it loaded, equal the learner's own
    log-probs of the same completions with the learner's weights of that version (kept at every step; to float32
    rounding): the publication moved the weights exactly. The same run with the weights never copied into the slots
    differs from the first batch made after an optimizer step."""
    from peft import LoraConfig

    def run(out):
        tok = tiny_tokenizer()
        args = run_args(out, max_completion_length=6, max_steps=4, learning_rate=5e-2, rollout_workers=1,
                        max_staleness=1)
        peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
        t = GRPOTrainer(tiny_model(tok), chars, args=args, train_dataset=dataset(), processing_class=tok,
                        peft_config=peft)
        weights = {}

        class Keep(TrainerCallback):  # the learner's trained tensors at every version
            def on_train_begin(self, args, state, control, **k):
                weights[0] = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}

            def on_step_end(self, args, state, control, **k):
                weights[state.global_step] = {n: p.detach().clone() for n, p in t.model.named_parameters()
                                              if p.requires_grad}

        t.add_callback(Keep())
        gaps, published = [], []
        finish = t.pipeline.finish

        def compare(samples, stats, driver, mode="train", behaviour_logps=None, **kw):
            g = samples.generation
            version = t.state.global_step - int(dict(stats.metrics)["sample/staleness_mean"])
            params = dict(t.model.named_parameters())
            now = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
            with torch.no_grad():
                for n, value in weights[version].items():
                    params[n].copy_(value)
                own = driver.policy_logps(samples.prompt_ids, samples.prompt_mask, g.completion_ids,
                                          g.completion_mask)
                for n, value in now.items():
                    params[n].copy_(value)
            m = g.completion_mask.bool()
            gaps.append((version, float((own - behaviour_logps).abs()[m].max())))
            published.append(t.pipeline.producer.producer.slots.bytes_per_publication)
            return finish(samples, stats, driver, mode, behaviour_logps=behaviour_logps, **kw)

        t.pipeline.finish = compare
        t.train()
        trainable = sum(p.numel() * p.element_size() for p in t.model.parameters() if p.requires_grad)
        return gaps, published, trainable

    gaps, published, trainable = run(tmp_path / "synced")
    assert len(gaps) == 4 and max(g for _, g in gaps) < 1e-4 and max(v for v, _ in gaps) >= 2, gaps
    assert published[0] == trainable  # LoRA: the adapter's tensors alone
    if lora:
        assert trainable < 0.2 * sum(p.numel() * 4 for p in tiny_model(tiny_tokenizer()).parameters())
    write = WeightSlots.write  # publications announced, their tensors never copied:
    monkeypatch.setattr(WeightSlots, "write", lambda self, version, tensors, copy=None:
                        write(self, version, tensors, copy=lambda dest, source: None))
    skipped, _, _ = run(tmp_path / "skipped")
    assert all(g < 1e-4 for v, g in skipped if v == 0) and max(g for v, g in skipped if v > 0) > 1e-3, skipped


FAULTS = dict(rollout_workers=2, max_staleness=1, dynamic_sampling=True, dynamic_sampling_max_rounds=4,
              dynamic_sampling_explore_prob=0.5, max_steps=5, save_strategy="steps", save_steps=100)
"""The settings of the fault tests: two workers running ahead, dynamic sampling and prompt skipping (each worker's
refill stream, keep rate and streaks: its state)."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list:
    """The prompts an uninterrupted run with :data:`FAULTS` trains on, batch by batch."""
    whole = make(tmp_path_factory.mktemp("whole"), spread_if_easy, **FAULTS)
    expected = record_trained(whole)
    whole.train()
    assert len(expected) == 5
    return expected


def test_a_killed_worker_is_restarted_and_no_prompt_is_lost_or_trained_twice(tmp_path, uninterrupted):
    kw, expected = FAULTS, uninterrupted

    killed = []

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **k):
            if state.global_step == 2:
                pid = t.pipeline.producer.producer.workers[0].pid
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    t = make(tmp_path / "killed", spread_if_easy, callbacks=[Kill()], **kw)
    trained = record_trained(t)
    t.train()
    assert killed and trained == expected
    logs = [h for h in t.state.log_history if "reward" in h]
    assert sum(h["rollout/worker_restarts_total"] for h in logs) == 1
    assert not psutil.pid_exists(killed[0]) or psutil.Process(killed[0]).status() == psutil.STATUS_ZOMBIE
    assert not worker_children()


def test_stopped_by_sigterm_and_resumed_it_trains_on_the_prompts_of_an_uninterrupted_run(tmp_path, uninterrupted):
    kw, expected = FAULTS, uninterrupted

    class Term(TrainerCallback):
        def on_step_end(self, args, state, control, **k):
            if state.global_step == 3:
                time.sleep(0.5)  # let the workers run ahead (and move their state) before the stop
                signal.raise_signal(signal.SIGTERM)

    first = make(tmp_path / "cut", spread_if_easy, callbacks=[Term()], **kw)
    before = record_trained(first)
    first.train()
    assert first.interrupted == signal.SIGTERM and len(before) == 3 and not worker_children()
    saved = json.loads((tmp_path / "cut" / "checkpoint-3" / "grpokit_state_0.json").read_text())
    assert saved["rollout_workers"] == 2 and len(saved["worker_states"]) == 2
    assert all(s["refill_position"] > 0 for s in saved["worker_states"])
    resumed = make(tmp_path / "cut", spread_if_easy, **kw)
    after = record_trained(resumed)
    resumed.train(resume_from_checkpoint="auto")
    assert before + after == expected
    other = make(tmp_path / "cut", spread_if_easy, **dict(kw, rollout_workers=1))
    with pytest.raises(ValueError, match="rollout_workers=1 does not match the checkpoint, written with "
                                         "rollout_workers=2"):
        other.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert not worker_children()


class FailsInAnotherProcess:
    """A reward whose unpickling fails in any process but the one that made it (as a reward whose module the worker
    cannot import would)."""

    def __init__(self):
        self.pid = os.getpid()
        self.__name__ = "fails_elsewhere"

    def __setstate__(self, state):
        if state["pid"] != os.getpid():
            raise ImportError("No module named 'my_private_rewards'")
        self.__dict__.update(state)

    def __call__(self, completions, **kw):
        return [0.0] * len(completions)


def test_a_worker_that_fails_at_start_stops_the_run_in_one_line(tmp_path):
    t = make(tmp_path, [chars, FailsInAnotherProcess()], rollout_workers=1, max_staleness=1)
    with pytest.raises(RolloutWorkerError, match=r"^rollout worker 0 \(pid \d+\) could not start: ImportError: No "
                                                 r"module named 'my_private_rewards'$"):
        t.train()
    assert not worker_children()


def raises_at_the_second_batch(completions, trainer_state, **kw):
    if trainer_state.global_step >= 1:
        raise ValueError("the grader is broken")
    return [len(set(c[0]["content"])) / 8 for c in completions]


def test_no_worker_is_left_after_an_error_or_sigint(tmp_path):
    t = make(tmp_path / "error", raises_at_the_second_batch, rollout_workers=1, max_staleness=0)
    with pytest.raises(RolloutWorkerError, match=r"rollout worker 0 \(pid \d+\) failed: RewardFunctionError: .*the "
                                                 "grader is broken"):
        t.train()
    assert not worker_children()

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **k):
            if state.global_step == 1:
                signal.raise_signal(signal.SIGINT)

    t = make(tmp_path / "sigint", callbacks=[Interrupt()], rollout_workers=2, max_staleness=1)
    t.train()
    assert t.interrupted == signal.SIGINT and not worker_children()


def stuck_at_the_second_batch(completions, trainer_state, **kw):
    if trainer_state.global_step == 1:
        time.sleep(6)
    return [len(set(c[0]["content"])) / 8 for c in completions]


def test_the_stall_watchdog_names_the_stuck_worker(tmp_path):
    t = make(tmp_path, stuck_at_the_second_batch, rollout_workers=1, max_staleness=0, stall_timeout_s=2,
             max_steps=2)
    t.train()
    reports = t.stall_watchdog.reports
    pid = [h for h in reports if "waiting for rollouts" in h]
    assert pid, reports
    assert "waiting for rollouts (worker 0, pid " in pid[0] and "scoring (function 'stuck_at_the_second_batch')" \
        in pid[0], pid[0]


KILLED = dict(rollout_workers=1, max_staleness=1, dynamic_sampling=True, dynamic_sampling_max_rounds=4,
              dynamic_sampling_explore_prob=0.5, max_steps=5, save_strategy="steps", save_steps=2)
"""The settings of the run killed with SIGKILL (record_run.py)."""


def test_sigkill_of_the_trainer_leaves_no_worker_and_the_resume_trains_the_same_prompts(tmp_path):
    """The trainer killed with SIGKILL at step 3 (the last checkpoint at step 2): its worker ends with it (the
    kernel's parent-death signal), and the resumed run trains steps 3-5 on the prompts the uninterrupted run does."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("record_run.py")

    def run(out, *extra):
        return subprocess.run([sys.executable, str(script), str(out), *extra], capture_output=True, text=True,
                              timeout=900)

    whole = make(tmp_path / "whole", spread_if_easy, **KILLED)  # the uninterrupted run, here
    expected = record_trained(whole)
    whole.train()
    killed = run(tmp_path / "cut", "--kill-at", "3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    pids = [int(p) for p in (tmp_path / "cut" / "pids.txt").read_text().split()]
    assert len(set(pids)) == 1
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "a worker outlived the trainer's SIGKILL"
        time.sleep(0.1)
    resumed = run(tmp_path / "cut", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def trained(out):
        return [json.loads(line) for line in (out / "trained.jsonl").read_text().splitlines()]

    cut = trained(tmp_path / "cut")
    assert len(expected) == 5 and len(cut) == 3 + 3  # steps 1-3 before the kill, 3-5 after the resume
    assert cut[:2] + cut[3:] == expected


class Echo:
    """An environment with one tool and no reward."""

    def reset(self, **row):
        self.said = ""

    def say(self, text: str) -> str:
        """Say something.

        Args:
            text: what to say
        """
        self.said = text
        return text


def pid_reward(completions, log_metric, **kw):
    """Logs the process it runs in."""
    log_metric("custom/pid", float(os.getpid()))
    return [len(set(c[-1]["content"])) / 8 for c in completions]


def test_tools_environments_and_rewards_run_in_the_worker(tmp_path):
    """Tools, an environment per row and the reward functions cross into the worker and run there: the same tool
    metrics and environment rewards as in the trainer's process, and the rewards logged from the worker's pid."""
    from scripted_tools import Counter, ScriptedBackend, args_for, tokenizer

    tok = tokenizer()
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Go {i}."}] for i in range(8)],
                            "environment": ["counter", "echo"] * 4, "target": [5] * 8})
    call = '<tool_call>{"name": "increment", "arguments": {"by": 5}}</tool_call>'
    backend = ScriptedBackend(tok, first=lambda i: call if i in (0, 1) else "done")
    t = GRPOTrainer(tiny_model(tok, max_positions=2048), [pid_reward],
                    args=args_for(tmp_path, shuffle_dataset=False, max_steps=2, per_device_train_batch_size=8,
                                  rollout_workers=1, max_staleness=1),
                    train_dataset=ds, processing_class=tok, rollout_backend=backend,
                    environment_factory={"counter": Counter, "echo": Echo})
    t.train()
    logs = [h for h in t.state.log_history if "reward" in h]
    assert len(logs) == 2
    assert logs[0]["tools/call_frequency"] == pytest.approx(2 / 8)
    assert logs[0]["rewards/Counter/mean"] == pytest.approx(0.5)
    assert all(h["custom/pid"] != os.getpid() for h in logs)  # scored in the worker
    assert not worker_children()
