"""Torch's thread count follows the free cores (grpokit/machine/threads.py)."""

import os

import pytest
import torch

from grpokit.machine import threads


@pytest.fixture
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("GRPOKIT_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores,load,start,expected", [
    (2, 0.1, 2, None),   # quiet: unchanged
    (2, 1.0, 2, 1),      # one other busy process on two cores
    (2, 3.7, 2, 1),      # never below one
    (16, 4.4, 16, 12),
    (4, 1.0, 2, None),   # already fewer threads than free cores
])
def test_threads_fit_the_free_cores(monkeypatch, restore_threads, cores, load, start, expected):
    monkeypatch.setattr(threads, "free_cores", lambda: (cores, load))
    torch.set_num_threads(start)
    said = threads.fit_torch_threads()
    if expected is None:
        assert said is None and torch.get_num_threads() == start
    else:
        assert torch.get_num_threads() == expected
        assert f"using {expected} torch thread" in said and "GRPOKIT_NUM_THREADS" in said


def test_the_users_choice_wins(monkeypatch, restore_threads):
    monkeypatch.setattr(threads, "free_cores", lambda: (2, 1.5))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert threads.fit_torch_threads() is None and torch.get_num_threads() == 2
    monkeypatch.setenv("GRPOKIT_NUM_THREADS", "1")
    assert threads.fit_torch_threads() is None and torch.get_num_threads() == 1
    monkeypatch.setenv("GRPOKIT_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="GRPOKIT_NUM_THREADS='many' is not allowed"):
        threads.fit_torch_threads()


def test_own_cpu_ticks_sum_the_process_and_its_descendants_only(monkeypatch):
    table = {"100": (1, 10), "101": (100, 5), "102": (101, 7), "200": (1, 50), "201": (200, 3)}
    monkeypatch.setattr(threads.os, "listdir", lambda path: [*table, "self", "cpuinfo"])
    monkeypatch.setattr(threads, "_proc_stat", lambda pid: table.get(pid))
    assert threads.own_cpu_ticks(100) == 10 + 5 + 7  # a child and a grandchild
    assert threads.own_cpu_ticks(101) == 5 + 7
    assert threads.own_cpu_ticks(300) is None  # not there


def test_own_cpu_ticks_count_a_live_child_on_this_machine(tmp_path):
    """Through /proc itself: a child that has burned CPU is counted in this process's ticks, not the other way."""
    import subprocess
    import sys

    if threads.own_cpu_ticks() is None:
        pytest.skip("no /proc here")
    burn = ("import time\n"
            "def ticks():\n"
            "    return sum(int(x) for x in open('/proc/self/stat').read().rsplit(')', 1)[1].split()[11:13])\n"
            "while ticks() < 5:\n"
            "    sum(range(10000))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before_own = threads._proc_stat(str(os.getpid()))[1]
        child_ticks = threads.own_cpu_ticks(child.pid)
        assert child_ticks >= 5
        assert threads.own_cpu_ticks() >= before_own + child_ticks
        assert threads.own_cpu_ticks(child.pid) == child_ticks  # asleep now; its parent is not its descendant
    finally:
        child.kill()
        child.wait()


class _Looks:
    """A follower's looks at the machine: each ``window_s`` later, other processes keeping ``busy`` of 2 CPUs busy
    and this process tree one."""

    def __init__(self, window_s=5.0):
        self.t, self.idle, self.total, self.own, self.window_s = 0.0, 0, 0, 0, window_s

    def advance(self, busy: float):
        ticks = int(self.window_s * 100)  # per CPU
        self.t += self.window_s
        self.total += 2 * ticks
        self.own += ticks  # this process: one core
        self.idle += int((2 - 1 - busy) * ticks) if busy < 1 else 0

    def __call__(self):
        return self.t, (self.idle, self.total), self.own


@pytest.fixture
def follower(monkeypatch, restore_threads):
    looks = _Looks()
    monkeypatch.setattr(threads.FreeCoresFollower, "_look", staticmethod(looks))
    monkeypatch.setattr(threads.time, "monotonic", lambda: looks.t)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "_usable_cores", lambda: 2)
    return looks


def test_threads_follow_the_free_cores_after_two_looks_that_agree(follower):
    torch.set_num_threads(1)  # as a job fitted them at a busy start
    f = threads.FreeCoresFollower(ceiling=2)
    said = []
    for busy in [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]:
        follower.advance(busy)
        said.append((f.follow(), torch.get_num_threads()))
    assert said[0] == (None, 1)  # still busy
    assert said[1] == (None, 1)  # quiet once: not yet
    line, n = said[2]  # quiet twice: the free core is taken back
    assert n == 2 and line == "other processes now keep 0.0 of 2 cores busy: using 2 torch threads instead of 1"
    assert said[3:6] == [(None, 2)] * 3  # one busy window alone changes nothing
    line, n = said[7]
    assert n == 1 and "keep 1.0 of 2 cores busy: using 1 torch thread instead of 2" in line


def test_threads_never_go_above_the_ceiling_nor_look_too_soon(follower):
    torch.set_num_threads(1)
    f = threads.FreeCoresFollower(ceiling=1)
    for _ in range(3):
        follower.advance(0.0)
        assert f.follow() is None and torch.get_num_threads() == 1
    f = threads.FreeCoresFollower(ceiling=2, min_window_s=60)
    for _ in range(3):
        follower.advance(0.0)  # 5 s apart: too soon to tell
        assert f.busy_elsewhere() is None
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("users_choice", [None, "OMP_NUM_THREADS", "GRPOKIT_NUM_THREADS"])
def test_a_job_started_on_a_busy_machine_takes_the_cores_back_when_they_are_free(
        monkeypatch, restore_threads, tmp_path, tiny_dir, capsys, users_choice):
    """A job (what ``grpokit train`` and the demo run) started while another process keeps the cores busy fits torch
    to one thread; once the machine is quiet it uses both again, from the step after two quiet looks, and says so. A
    count the user chose is never changed."""
    from transformers import TrainerCallback

    from grpokit.run.job import run_job

    torch.set_num_threads(2)
    if users_choice:
        monkeypatch.setenv(users_choice, "2")
    monkeypatch.setattr(threads, "free_cores", lambda: (2, 1.9))  # busy at the start
    monkeypatch.setattr(threads.FreeCoresFollower, "busy_elsewhere", lambda self: 0.0)  # quiet from then on
    seen = []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            seen.append(torch.get_num_threads())

    spec = {"model": str(tiny_dir), "task": "arithmetic", "output_dir": str(tmp_path / "run"),
            "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8, "max_steps": 4,
            "save_strategy": "no", "report_to": "none", "use_cpu": True, "eval": {"n": 4, "max_new_tokens": 8}}
    run_job(spec, quiet=True, callbacks=[Record()])
    text = capsys.readouterr().out
    if users_choice:
        assert "torch thread" not in text and seen == [2, 2, 2, 2]
    else:
        assert "other processes keep 1.9 of 2 cores busy: using 1 torch thread instead of 2" in text  # at the start
        assert "other processes now keep 0.0 of 2 cores busy: using 2 torch threads instead of 1" in text
        assert seen == [1, 1, 2, 2]  # two quiet looks, after steps 1 and 2
