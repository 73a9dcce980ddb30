"""Reward functions for the reward-process tests (test_rel_reward_process.py), in a module of their own that imports
nothing heavy: the reward process imports it to unpickle them, under its memory limit."""

from __future__ import annotations

import os
import time

CHUNK = 32 * 2**20


def chars(completions, log_metric, **kw):
    """Distinct characters of the reply; logs the process it ran in."""
    log_metric("custom/pid", float(os.getpid()))
    return [len(set(c[0]["content"])) / 8.0 for c in completions]


def fifty_gb_at_the_first_step(completions, trainer_state, **kw):
    """Allocates 50 GB at step 0; 1.0 for every row after."""
    if trainer_state.global_step == 0:
        hoard = bytearray(50 * 2**30)
        return [float(len(hoard))] * len(completions)
    return [1.0] * len(completions)


def grows_until_stopped(completions, trainer_state, progress_file, **kw):
    """At step 0, takes memory 32 MB at a time (every page written), recording how much it holds after each chunk."""
    if trainer_state.global_step == 0:
        held = []
        while True:
            held.append(b"x" * CHUNK)
            with open(progress_file[0], "w") as f:
                f.write(str(len(held) * CHUNK))
    return [1.0] * len(completions)


def hangs_at_the_first_step(completions, trainer_state, pid_file, **kw):
    """Writes its process's pid, then at step 0 sleeps far past any bound under test."""
    with open(pid_file[0], "a") as f:
        f.write(f"{os.getpid()}\n")
    if trainer_state.global_step == 0:
        time.sleep(3600)
    return [1.0] * len(completions)


def always_raises(completions, **kw):
    raise ValueError("nothing here is scorable")
