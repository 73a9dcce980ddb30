"""The job's time budget (grpokit/callbacks/training.py ``TimeBudget``): training stops when another step as long as
the slowest recent one would overrun it, and under data parallelism every process stops at the same step even when
their clocks disagree (a process that stopped alone would leave the others waiting in their next collective)."""

import subprocess
import sys
import textwrap
import types

from transformers import TrainerControl

import grpokit.callbacks.training as training
from grpokit.callbacks import TimeBudget


def steps_until_stop(monkeypatch, budget, step_seconds):
    clock = [0.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock[0])
    cb, control = TimeBudget(budget), TrainerControl()
    cb.on_train_begin(None, None, control)
    for n, seconds in enumerate(step_seconds, 1):
        clock[0] += seconds
        if cb.on_step_end(types.SimpleNamespace(device="cpu"), None, control).should_training_stop:
            return n
    return None


def test_stops_before_a_step_as_slow_as_the_slowest_recent_one_would_overrun(monkeypatch):
    assert steps_until_stop(monkeypatch, 100, [10] * 20) == 10  # at 100 s another 10 s step would overrun
    assert steps_until_stop(monkeypatch, 100, [10, 30, 10, 10, 10, 10]) == 6  # 80 s + the 30 s step, still recent
    assert steps_until_stop(monkeypatch, 1000, [10] * 20) is None


SCRIPT = textwrap.dedent("""
    import sys, types
    import torch.distributed as dist
    import grpokit.callbacks.training as training
    from grpokit.callbacks import TimeBudget
    from grpokit.bounds.process_group import exit_process
    from transformers import TrainerControl

    rank, store, late = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    clock = [0.0]
    training.time.perf_counter = lambda: clock[0]
    cb, control = TimeBudget(100.0), TrainerControl()
    cb.on_train_begin(None, None, control)
    step = 0
    while not control.should_training_stop and step < 50:
        step += 1
        clock[0] += 10.0 + (late if step == 3 else 0.0)  # this process's clock: one step seen as slower
        cb.on_step_end(types.SimpleNamespace(device="cpu"), None, control)
    print("stopped at", step, end="")
    exit_process(0)
""")


def test_every_process_stops_at_the_step_the_first_one_would(tmp_path):
    store = str(tmp_path / "store")
    # rank 1 sees step 3 as 50 s: alone it stops after it (70 s + 50 > 100); rank 0 alone would go on to step 9
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(rank), store, str(40.0 * rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert [stdout for stdout, _ in outs] == ["stopped at 3", "stopped at 3"]
