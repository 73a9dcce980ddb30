"""``lr_schedule_clock: budget`` (grpokit/training/budget_schedule.py, grpokit/callbacks/training.py ``TimeBudget``):
after the warmup the learning-rate schedule follows the further along of the steps and the time budget, so a run the
budget stops early still ends at the schedule's end; a run that reaches ``max_steps`` first is scheduled by steps."""

import json
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from transformers import TrainerControl, get_scheduler

import grpokit.callbacks.training as training
from grpokit.callbacks import TimeBudget
from grpokit.cli import main
from grpokit.run.job_spec import JobError, check_job_keys
from grpokit.training.budget_schedule import budget_schedule_step, run_on_budget_clock


def test_the_schedule_step_is_the_further_along_of_steps_and_time_after_the_warmup():
    # C = 10 (the warmup's end), S = 130: the warmup counts steps whatever the clock says
    assert budget_schedule_step(3, 10, 130, 0.9) == 3
    assert budget_schedule_step(9, 10, 130, 1.0) == 9
    # after it: time ahead of the steps moves the schedule on, steps ahead of the time keep it by steps
    assert budget_schedule_step(40, 10, 130, 0.5) == 10 + 120 * 0.5  # 70: time ahead
    assert budget_schedule_step(100, 10, 130, 0.5) == 100  # steps ahead
    assert budget_schedule_step(40, 10, 130, 1.0) == 130  # the budget spent: the schedule's end
    assert budget_schedule_step(40, 10, 130, 7.0) == 130 and budget_schedule_step(40, 10, 130, -1.0) == 40  # clipped
    assert budget_schedule_step(200, 10, 130, 0.0) == 130  # never past its end
    assert budget_schedule_step(5, 0, 0, 0.5) == 5  # no steps after a warmup to stretch


def wsd(max_steps=130):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return get_scheduler("warmup_stable_decay", opt, num_warmup_steps=10, num_training_steps=max_steps,
                         scheduler_specific_kwargs={"num_stable_steps": 40, "num_decay_steps": 80,
                                                    "decay_type": "linear"})


def test_transformers_schedule_evaluated_at_the_budget_step():
    by_steps, on_budget = wsd(), wsd()
    fraction = [0.0]
    run_on_budget_clock(on_budget, 10, 130, lambda: fraction[0])
    rates = []
    for step in range(1, 60):
        fraction[0] = min(1.0, max(0, step - 10) / 30)  # the budget after the warmup spans 30 steps
        for scheduler in (by_steps, on_budget):
            scheduler.optimizer.step()
            scheduler.step()
        rates.append((by_steps.get_last_lr()[0], on_budget.get_last_lr()[0]))
    assert [a for a, _ in rates[:9]] == [b for _, b in rates[:9]]  # the warmup: the same rates
    assert rates[20][0] == 1.0 and 0 < rates[20][1] < 1.0  # step 21: still stable by steps, decaying on the budget
    assert rates[40][1] == 0.0 and rates[40][0] == 1.0  # step 41: the budget spent, the schedule at its end
    assert on_budget.state_dict()["last_epoch"] == by_steps.state_dict()["last_epoch"] == 59


def test_a_scheduler_without_step_lambdas_is_refused_in_one_line():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(ValueError, match="lr_schedule_clock='budget' is not allowed with a ReduceLROnPlateau"):
        run_on_budget_clock(plateau, 0, 10, lambda: 0.0)


def run_callback(monkeypatch, budget, step_seconds, max_steps=130, resumed_at=0):
    """The callback with a scheduler, on a fake clock: (the rate of each step, the step training stopped at)."""
    clock = [0.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock[0])
    scheduler, control = wsd(max_steps), TrainerControl()
    for _ in range(resumed_at):  # as a checkpoint restores it: the steps done
        scheduler.optimizer.step()
        scheduler.step()
    args = types.SimpleNamespace(device="cpu", get_warmup_steps=lambda n: 10)
    state = types.SimpleNamespace(max_steps=max_steps, global_step=resumed_at)
    cb = TimeBudget(budget, schedule=True)
    cb.on_train_begin(args, state, control, lr_scheduler=scheduler)
    rates = []
    for step in range(resumed_at + 1, max_steps + 1):
        rates.append(scheduler.get_last_lr()[0])  # the rate this step trains with
        clock[0] += step_seconds
        scheduler.optimizer.step()
        scheduler.step()  # transformers steps the scheduler before on_step_end
        state.global_step = step
        if cb.on_step_end(args, state, control).should_training_stop:
            return rates, step
    return rates, None


def test_a_budget_that_ends_first_compresses_the_schedule_to_its_end(monkeypatch):
    rates, stopped = run_callback(monkeypatch, 550, 7.0)  # 78 steps fit where the schedule has 130
    assert stopped == 78
    peak = max(rates)
    assert rates[:10] == [r for r in wsd_rates()[:10]]  # the warmup by steps
    decay = rates[10:]
    assert all(b <= a for a, b in zip(decay, decay[1:]))  # never rises after the warmup
    assert rates[-1] < 0.05 * peak  # the last step at the schedule's end, as step 130 is by steps
    assert rates[40] < peak  # already decaying where the steps alone would hold it (step 50)


def test_a_resumed_run_spreads_what_is_left_over_its_own_budget(monkeypatch):
    rates, stopped = run_callback(monkeypatch, 140, 7.0, resumed_at=60)  # 20 more steps fit, 70 are left
    assert stopped == 80
    assert rates[0] == wsd_rates()[60]  # it goes on from the step it resumed at
    assert all(b <= a for a, b in zip(rates, rates[1:])) and rates[-1] < 0.1 * max(wsd_rates())


def test_a_budget_that_ends_after_max_steps_changes_nothing(monkeypatch):
    rates, stopped = run_callback(monkeypatch, 550, 3.0)  # 130 steps take 390 s
    assert stopped is None and rates == wsd_rates()


def wsd_rates():
    scheduler, rates = wsd(), []
    for _ in range(130):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def test_the_job_key_is_checked_in_one_line():
    base = {"model": "m", "task": "arithmetic"}
    with pytest.raises(JobError, match=r"^lr_schedule_clock='time' is not allowed: use one of 'steps', 'budget'$"):
        check_job_keys(base | {"lr_schedule_clock": "time"})
    with pytest.raises(JobError, match="lr_schedule_clock='budget' is not allowed without time_budget_s"):
        check_job_keys(base | {"lr_schedule_clock": "budget"})
    check_job_keys(base | {"lr_schedule_clock": "budget", "finish_within_s": 600})


def test_a_job_stopped_by_its_budget_ends_at_the_schedules_end(tmp_path, tiny_dir):
    """Through ``grpokit train``: a linear schedule over 2000 steps and a budget that holds a small share of them.
    By steps the run ends near the peak rate; on the budget's clock it falls every step to near 0."""
    import yaml

    last = {}
    for clock in ("steps", "budget"):
        out = tmp_path / clock
        spec = {"model": str(tiny_dir), "task": "arithmetic", "output_dir": str(out), "per_device_train_batch_size": 4,
                "num_generations": 4, "max_completion_length": 4, "max_steps": 2000, "logging_steps": 1,
                "save_strategy": "no", "report_to": "none", "gradient_checkpointing": False, "use_cpu": True,
                "learning_rate": 1e-3, "lr_scheduler_type": "linear", "warmup_steps": 2,
                "eval": {"before": False, "after": False}, "time_budget_s": 6, "lr_schedule_clock": clock}
        (tmp_path / f"{clock}.yaml").write_text(yaml.safe_dump(spec))
        assert main(["train", str(tmp_path / f"{clock}.yaml"), "--quiet"]) == 0
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        rates = [x["learning_rate"] for x in lines if "learning_rate" in x]
        assert 4 <= len(rates) < 2000  # stopped by the budget, after the warmup
        last[clock] = rates
    assert last["steps"][-1] > 0.5e-3  # a few hundred steps of 2000 down the linear decay
    after_warmup = last["budget"][2:]
    assert all(b <= a for a, b in zip(after_warmup, after_warmup[1:]))
    assert last["budget"][-1] < 0.3e-3 and last["budget"][-1] < last["steps"][-1]  # ~1% of the peak on a quiet CPU


RANKS = textwrap.dedent("""
    import sys, types
    import torch, torch.distributed as dist
    from transformers import TrainerControl, get_scheduler
    import grpokit.callbacks.training as training
    from grpokit.callbacks import TimeBudget
    from grpokit.bounds.process_group import exit_process

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    clock = [0.0]
    training.time.perf_counter = lambda: clock[0]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=100)
    args = types.SimpleNamespace(device="cpu", get_warmup_steps=lambda n: 2)
    state = types.SimpleNamespace(max_steps=100, global_step=0)
    cb, control = TimeBudget(100.0, schedule=True), TrainerControl()
    cb.on_train_begin(args, state, control, lr_scheduler=scheduler)
    rates = []
    for step in range(1, 8):
        clock[0] += 5.0 + 3.0 * rank  # rank 1's clock runs faster: alone it would schedule further along
        opt.step()
        scheduler.step()
        rates.append(round(scheduler.get_last_lr()[0], 9))
        state.global_step = step
        cb.on_step_end(args, state, control)
    print(rates, end="")
    exit_process(0)
""")


def test_every_process_trains_at_the_rate_of_the_furthest_clock(tmp_path):
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", RANKS, str(rank), store], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    rates = [json.loads(stdout) for stdout, _ in outs]
    assert rates[0] == rates[1]  # one rate for the replicas
    by_steps = [1 - (s - 2) / 98 for s in range(3, 8)]
    assert all(r < s for r, s in zip(rates[0][3:], by_steps[1:]))  # the budget's clock ahead of the steps
