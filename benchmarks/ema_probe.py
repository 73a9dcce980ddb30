"""Does averaging the trained weights (``ema_decay``) help the demo? One run of the demo's recipe (seed, step count
fixed), with the held-out accuracy of the trained weights and of their moving average measured at the same steps:
a paired comparison on one trajectory (training does not depend on the average).

    python benchmarks/ema_probe.py --steps 60 --every 10 --decays 0.8 0.9 0.95     # ~12 min on a 2-core CPU
    python benchmarks/ema_probe.py --steps 2 --every 1 --n 8                         # a quick check

Prints one line per evaluation and writes runs/ema_probe/seed<S>.json. docs/algorithms.md ("9. Weight averaging") holds the
numbers. The job is the demo's (``grpokit.run.job.run_job``, quiet), the averages the probe's own
(:class:`grpokit.training.weight_average.WeightAverage`, one per decay).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=128, help="held-out questions per evaluation")
    ap.add_argument("--decays", type=float, nargs="+", default=[0.9])
    ns = ap.parse_args()
    sys.path.insert(0, str(ROOT))

    from transformers import TrainerCallback

    from grpokit.cli import demo_spec
    from grpokit.evaluation import evaluate
    from grpokit.run.files import atomic_write_text
    from grpokit.run.job import prepare, run_job
    from grpokit.training.weight_average import WeightAverage

    out = ROOT / "runs" / "ema_probe"
    spec = demo_spec("grpo")  # the demo's job, with the probe's averages instead of the trainer's own
    spec.update(output_dir=str(out / f"seed{ns.seed}"), seed=ns.seed, max_steps=ns.steps, ema_decay=None)
    spec.pop("time_budget_s", None)
    spec["eval"] = {**spec["eval"], "before": False, "after": False, "every_steps": None}
    task, ev = prepare(spec).task, spec["eval"]  # the job's own held-out questions (validation only, nothing loaded)
    records: list[dict] = []

    class Probe(TrainerCallback):
        """One average per decay; at every ``--every``-th step and the last, the trained weights and each average
        evaluated on the same held-out questions."""

        def __init__(self):
            self.averages: list[WeightAverage] = []

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.averages = [WeightAverage(model, d) for d in ns.decays]

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            for average in self.averages:
                average.update()
            step = state.global_step
            if step % ns.every and step != ns.steps:
                return

            def accuracy() -> float:
                return float(evaluate(model, processing_class, task.eval_dataset, task.reward_funcs,
                                      accuracy_reward=task.accuracy_reward, max_new_tokens=int(ev["max_new_tokens"]),
                                      greedy=True, n=ns.n)[0]["accuracy"])

            row = {"step": step, "trained": accuracy()}
            for d, average in zip(ns.decays, self.averages):
                with average.applied():
                    row[f"ema{d}"] = accuracy()
            records.append(row)
            print(" | ".join(f"{k} {v:.1%}" if k != "step" else f"step {v}" for k, v in row.items()), flush=True)

    run_job(spec, quiet=True, overwrite=True, callbacks=[Probe()])
    path = out / f"seed{ns.seed}.json"
    atomic_write_text(path, json.dumps({"steps": ns.steps, "decays": ns.decays, "evaluations": records}, indent=1))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
