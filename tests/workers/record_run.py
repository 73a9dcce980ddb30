"""A training run with rollout workers in a process of its own, for tests that kill it: it appends the prompts of
every batch the learner finishes to ``<out>/trained.jsonl`` and the workers' pids to ``<out>/pids.txt``, and with
``--kill-at N`` ends itself with SIGKILL at the end of step N (a checkpoint every 2 steps).

    python record_run.py OUT [--kill-at N] [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from test_workers_trainer import KILLED, make, spread_if_easy  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    a = parser.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            with open(out / "pids.txt", "a") as f:
                f.write(" ".join(str(p) for p in trainer.pipeline.producer.producer.pids) + "\n")
            if state.global_step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = make(out / "run", spread_if_easy, callbacks=[Record()], **KILLED)
    finish = trainer.pipeline.finish

    def record(samples, stats, driver, mode="train", **kw):
        if mode == "train":
            with open(out / "trained.jsonl", "a") as f:
                f.write(json.dumps([p[0]["content"] for p in samples.prompts[::4]]) + "\n")
        return finish(samples, stats, driver, mode, **kw)

    trainer.pipeline.finish = record
    trainer.train(resume_from_checkpoint="auto" if a.resume else None)


if __name__ == "__main__":
    main()
