"""Reward functions in a process of their own (``reward_process=True``, grpokit/rewards/process.py), through
GRPOTrainer: the same training as in the trainer's process; a reward that allocates without bound is stopped at
``worker_memory_mb`` and counted as failed while the trainer trains on; a hung call is ended with its process; nothing
that cannot cross is accepted; no process is left behind, not even after a SIGKILL of the trainer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from datasets import Dataset
from reliability_helpers import make_args
from reward_process_rewards import (
    CHUNK,
    always_raises,
    chars,
    fifty_gb_at_the_first_step,
    grows_until_stopped,
    hangs_at_the_first_step,
)
from tiny import tiny_model, tiny_tokenizer

from grpokit.rewards import RewardFunctionError
from grpokit.trainer import GRPOTrainer

HERE = Path(__file__).resolve().parent


def dataset(n: int = 8, **columns) -> Dataset:
    rows = {"prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(n)]}
    rows.update({k: [v] * n for k, v in columns.items()})
    return Dataset.from_dict(rows)


def trainer(out, rewards, data=None, **kw) -> GRPOTrainer:
    tok = tiny_tokenizer()
    return GRPOTrainer(tiny_model(tok), rewards, args=make_args(out, **kw), train_dataset=data or dataset(),
                       processing_class=tok)


def reward_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "process_child" in " ".join(p.cmdline())]


def logs(t) -> list[dict]:
    return [h for h in t.state.log_history if "reward" in h]


def test_the_same_training_as_in_the_trainer_s_process_with_the_rewards_elsewhere(tmp_path):
    here = trainer(tmp_path / "here", [chars])
    here.train()
    there = trainer(tmp_path / "there", [chars], reward_process=True)
    there.train()
    drop = ("step_time", "custom/pid")
    assert [{k: v for k, v in h.items() if k not in drop} for h in logs(there)] == [
        {k: v for k, v in h.items() if k not in drop} for h in logs(here)]
    assert all(h["custom/pid"] == os.getpid() for h in logs(here))  # log_metric from the process, replayed
    assert all(h["custom/pid"] != os.getpid() for h in logs(there))
    for (n, a), b in zip(here.model.named_parameters(), there.model.parameters()):
        assert a.equal(b), n
    assert not reward_children()  # stopped when training ended


def test_a_reward_that_allocates_50_gb_fails_alone_and_the_trainer_trains_on(tmp_path, caplog):
    t = trainer(tmp_path / "out", [chars, fifty_gb_at_the_first_step], reward_process=True, worker_memory_mb=1024)
    with caplog.at_level("WARNING", logger="grpokit"):
        t.train()
    first, second = logs(t)
    assert t.state.global_step == 2
    assert first["rewards/fifty_gb_at_the_first_step/failed_total"] == 1.0
    assert "rewards/fifty_gb_at_the_first_step/mean" not in first  # its rows unscored at that step
    assert second["rewards/fifty_gb_at_the_first_step/mean"] == 1.0  # a fresh process scores the next
    assert first["custom/pid"] != second["custom/pid"]
    assert ("reward function 'fifty_gb_at_the_first_step' failed in the reward process on the batch of 4 completions"
            in caplog.text and "it ran out of memory (worker_memory_mb=1024: MemoryError" in caplog.text)


def test_the_limit_is_worker_memory_mb_not_the_machine_s(tmp_path):
    """Memory taken a page at a time (no single request the kernel refuses outright) is stopped at the limit: the
    reward recorded how much it held, and that is under worker_memory_mb; the trainer's own memory did not grow."""
    progress = tmp_path / "held"
    rss_before = psutil.Process().memory_info().rss
    t = trainer(tmp_path / "out", [chars, grows_until_stopped], dataset(progress_file=str(progress)),
                reward_process=True, worker_memory_mb=512)
    t.train()
    held = int(progress.read_text())
    assert 64 * 2**20 <= held <= 512 * 2**20, held
    assert logs(t)[0]["rewards/grows_until_stopped/failed_total"] == 1.0
    assert psutil.Process().memory_info().rss - rss_before < held  # none of it in the trainer
    assert CHUNK == 32 * 2**20


def test_a_hung_call_is_ended_with_its_process_at_the_bound(tmp_path, caplog):
    pids = tmp_path / "pids"
    t = trainer(tmp_path / "out", [chars, hangs_at_the_first_step], dataset(pid_file=str(pids)),
                reward_process=True, reward_timeout_s=2.0)
    with caplog.at_level("WARNING", logger="grpokit"):
        t.train()
    first, second = logs(t)
    assert first["rewards/hangs_at_the_first_step/timeout_total"] == 1.0
    assert second["rewards/hangs_at_the_first_step/mean"] == 1.0
    hung, later = [int(x) for x in pids.read_text().split()]
    assert hung != later
    assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE  # ended, not abandoned
    assert ("reward function 'hangs_at_the_first_step' did not return within 2 s (its process was ended and is "
            "started again) on the batch of 4 completions") in caplog.text


def test_a_reward_that_raises_stops_the_run_naming_it_and_the_row(tmp_path):
    t = trainer(tmp_path / "out", [always_raises], reward_process=True)
    with pytest.raises(RewardFunctionError) as e:
        t.train()
    assert str(e.value).startswith("reward function 'always_raises' raised ValueError: nothing here is scorable on "
                                   "row 0 of 4 (prompt ")
    t.pipeline.stop()
    assert not reward_children()


def test_a_reward_that_cannot_cross_is_refused_in_one_line(tmp_path):
    connection = socket.socket()

    def remote(completions, **kw):
        connection.sendall(b"score these")
        return [0.0] * len(completions)

    try:
        with pytest.raises(ValueError) as e:
            trainer(tmp_path / "out", [chars, remote], reward_process=True)
    finally:
        connection.close()
    message = str(e.value)
    assert message.startswith("reward_funcs[1] ('remote') cannot cross into the reward process (reward_process=True): "
                              "TypeError: cannot pickle 'socket' object.")
    assert "\n" not in message
    # plain data, a lambda, a closure and a lock (each process gets a lock of its own) cross
    scale, lock = 3.0, threading.Lock()

    def locked(completions, **kw):
        with lock:
            return [scale] * len(completions)

    trainer(tmp_path / "ok", [lambda completions, **kw: [scale] * len(completions), locked], reward_process=True)


def test_an_environment_factory_with_a_reward_process_is_refused(tmp_path):
    class Counter:
        def reset(self, **row):
            return None

        def get_reward(self) -> float:
            return 1.0

    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"^reward_process=True is not allowed with environment_factory: "):
        GRPOTrainer(tiny_model(tok), [chars], args=make_args(tmp_path / "out", reward_process=True),
                    train_dataset=dataset(), processing_class=tok, environment_factory=Counter)


TRAINER_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {here!r}]
from reliability_helpers import make_args
from reward_process_rewards import hangs_at_the_first_step
from test_rel_reward_process import dataset
from tiny import tiny_model, tiny_tokenizer
from grpokit.trainer import GRPOTrainer

tok = tiny_tokenizer()
GRPOTrainer(tiny_model(tok), [hangs_at_the_first_step], args=make_args({out!r}, reward_process=True,
            reward_timeout_s={bound!r}, max_steps=3), train_dataset=dataset(pid_file={pids!r}),
            processing_class=tok).train()
"""


@pytest.mark.parametrize("how,bound", [(signal.SIGKILL, None), (signal.SIGTERM, 2.0)], ids=["SIGKILL", "SIGTERM"])
def test_no_reward_process_outlives_its_trainer(tmp_path, how, bound):
    """SIGKILL while a reward hangs with no bound: the kernel ends the process with its parent. SIGTERM: the trainer
    ends the hung call at its bound, stops at the step's end, and its process goes with it."""
    pids = tmp_path / "pids"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINER_SCRIPT.format(tests=str(HERE.parent), here=str(HERE), bound=bound,
                                                            out=str(tmp_path / "out"), pids=str(pids))))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600  # a hang guard: the trainer starts in seconds
        while not (pids.is_file() and pids.read_text().strip()) and proc.poll() is None:
            assert time.monotonic() < deadline, "the reward never ran"
            time.sleep(0.1)
        proc.send_signal(how)
        proc.wait(timeout=600)
        deadline = time.monotonic() + 60  # the kernel's parent-death signal, or the trainer's exit, ends it
        for child in {int(pid) for pid in pids.read_text().split()}:
            while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"the reward process {child} outlived its trainer ({how!r})"
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in (pids.read_text().split() if pids.is_file() else []):  # a failed run leaves none behind either
            if psutil.pid_exists(int(pid)):
                psutil.Process(int(pid)).kill()
