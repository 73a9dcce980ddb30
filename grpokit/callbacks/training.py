"""The trainer's own hooks into transformers' training loop, and the time budget of a job."""

from __future__ import annotations

import time

from transformers import TrainerCallback

from ..bounds.process_group import max_over_processes
from .stall import StallWatchdog


def install_hooks(trainer) -> StallWatchdog | None:
    """Add the trainer's :class:`TrainerHooks` and, with ``stall_timeout_s``, the watchdog (returned; None without)."""
    trainer.add_callback(TrainerHooks(trainer))
    if trainer.args.stall_timeout_s is None:
        return None
    stall = StallWatchdog(trainer)
    trainer.add_callback(stall)
    return stall


class TrainerHooks(TrainerCallback):
    """Forwards the training loop's events to the GRPO trainer, which changes its own state in its own methods:
    the rollout schedule on (re)start and its end, the non-finite-gradient guard before each optimizer step, the
    weights asynchronous rollouts get after it, and the wall time of each optimizer step (generation included) as the
    ``step_time`` metric."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.start: float | None = None

    def on_train_begin(self, args, state, control, **kw):
        self.trainer.begin_training(state)

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.trainer.guard_gradients(state)

    def on_step_begin(self, args, state, control, **kw):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.trainer.after_optimizer_step(state)
        if self.start is not None:
            self.trainer.record_metric("step_time", time.perf_counter() - self.start)

    def on_train_end(self, args, state, control, **kw):
        self.trainer.end_training()


class TimeBudget(TrainerCallback):
    """Stop training before ``seconds`` of training wall time are used up: after each optimizer step, stop when
    another step as long as the slowest of the last few would overrun the budget. Under data parallelism every
    process stops when any one would (each reads its own clock; a process that stopped alone would leave the others
    waiting in their next collective).

    With ``schedule`` (the job's ``lr_schedule_clock: budget``) the learning-rate schedule also runs on this clock
    (:mod:`grpokit.training.budget_schedule`): after the warmup it is evaluated at the further along of the steps
    done and the budget's time spent, projected to the start of the step whose rate is being set (the scheduler
    sets a step's rate at the end of the step before it, and this share is measured one step earlier still), as the
    step counter gives a step's rate by the steps done before it; so the steps the budget holds cover the whole
    schedule, the last at its end. Every process uses the largest share any process measured, so the replicas keep one rate."""

    def __init__(self, seconds: float, schedule: bool = False):
        self.seconds = seconds
        self.schedule = schedule
        self.start: float | None = None
        self.last: float | None = None
        self.recent: list[float] = []
        self.clock_from = 0  # the step the schedule's clock starts at (the warmup's end, or a resumed run's start)
        self.clock_start: float | None = None  # when that step ended (or training began, resumed after it)
        self.fraction = 0.0  # the share of the budget after clock_from spent when the step after the next begins

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kw):
        self.start = self.last = time.perf_counter()
        self.recent, self.clock_start, self.fraction = [], None, 0.0
        if self.schedule:
            from ..training.budget_schedule import run_on_budget_clock

            # from the warmup's end; a run resumed after it (its budget counts afresh) from its first step
            self.clock_from = max(args.get_warmup_steps(state.max_steps), state.global_step)
            if state.global_step >= self.clock_from:
                self.clock_start = self.start
            run_on_budget_clock(lr_scheduler, self.clock_from, state.max_steps, lambda: self.fraction)

    def on_step_end(self, args, state, control, **kw):
        if self.start is None:
            return control
        now = time.perf_counter()
        self.recent = (self.recent + [now - self.last])[-5:]
        self.last = now
        stop = now - self.start + max(self.recent) > self.seconds
        fraction = 0.0
        if self.schedule:
            if self.clock_start is None and state.global_step >= self.clock_from:
                self.clock_start = now
            if self.clock_start is not None:
                # the scheduler has set the next step's rate already: this share is for the step after it, which
                # starts when the next one ends
                step = sorted(self.recent)[len(self.recent) // 2]
                left = self.start + self.seconds - self.clock_start
                fraction = (now + step - self.clock_start) / left if left > 0 else 1.0
        stop, self.fraction = max_over_processes([float(stop), fraction], args.device)
        if stop:
            control.should_training_stop = True
        return control
