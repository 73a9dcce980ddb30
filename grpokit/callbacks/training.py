"""The trainer's own hooks into transformers' training loop, and the time budget of a job."""

from __future__ import annotations

import time

from transformers import TrainerCallback

from ..bounds.process_group import any_process
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
    waiting in their next collective)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start: float | None = None
        self.last: float | None = None
        self.recent: list[float] = []

    def on_train_begin(self, args, state, control, **kw):
        self.start = self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if self.start is None:
            return control
        now = time.perf_counter()
        self.recent = (self.recent + [now - self.last])[-5:]
        self.last = now
        if any_process(now - self.start + max(self.recent) > self.seconds, args.device):
            control.should_training_stop = True
        return control


class FollowFreeCores(TrainerCallback):
    """After each optimizer step, torch's CPU threads follow the free cores
    (:class:`grpokit.machine.threads.FreeCoresFollower`); ``say`` gets the line when the count changes."""

    def __init__(self, follower, say):
        self.follower, self.say = follower, say

    def on_step_end(self, args, state, control, **kw):
        line = self.follower.follow()
        if line:
            self.say(line)
        return control
