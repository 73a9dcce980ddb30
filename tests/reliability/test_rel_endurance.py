"""200 optimizer steps on a tiny model: resident memory does not grow after warm-up."""

from __future__ import annotations

import gc
import os
import time

from reliability_helpers import make_trainer
from transformers import TrainerCallback

STEPS = 200
WARMUP = 20
MAX_GROWTH_MB = 25.0


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class RSS(TrainerCallback):
    def __init__(self):
        self.at: dict[int, float] = {}

    def on_step_end(self, args, state, control, **kw):
        if state.global_step in (WARMUP, 100, STEPS):
            gc.collect()
            self.at[state.global_step] = rss_mb()


def test_no_memory_growth_over_200_steps(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=STEPS, logging_steps=1, learning_rate=1e-3, per_device_train_batch_size=2,
                           num_generations=2, max_completion_length=6)
    probe = RSS()
    trainer.add_callback(probe)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    growth = probe.at[STEPS] - probe.at[WARMUP]
    print(f"\nRSS after step {WARMUP}: {probe.at[WARMUP]:.1f} MB, step 100: {probe.at[100]:.1f} MB, "
          f"step {STEPS}: {probe.at[STEPS]:.1f} MB; growth {growth:+.1f} MB over {STEPS - WARMUP} steps "
          f"({seconds:.0f} s)")
    assert trainer.state.global_step == STEPS
    assert growth < MAX_GROWTH_MB
