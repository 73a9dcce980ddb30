"""Does averaging the trained weights (``ema_decay``) help the demo? One run of the demo's recipe (seed, step count
fixed), with the held-out accuracy of the trained weights and of their moving average measured at the same steps:
a paired comparison on one trajectory (training does not depend on the average).

    python benchmarks/ema_probe.py --steps 60 --every 10 --decays 0.8 0.9 0.95     # ~12 min on a 2-core CPU
    python benchmarks/ema_probe.py --steps 2 --every 1 --n 8                         # a quick check

Prints one line per evaluation and writes runs/ema_probe/seed<S>.json. docs/demo.md ("Weight averaging") holds the
numbers. Each decay's average is kept beside the trainer's own (``ema_decay`` = the first decay).
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

    import transformers
    from transformers import TrainerCallback

    from grpokit.cli import demo_spec
    from grpokit.evaluation import evaluate
    from grpokit.files import atomic_write_text
    from grpokit.job import lora_config, prepare
    from grpokit.models import load_model, load_tokenizer, no_progress_bars
    from grpokit.threads import fit_torch_threads
    from grpokit.trainer import GRPOTrainer
    from grpokit.weight_average import WeightAverage

    out = ROOT / "runs" / "ema_probe"
    spec = demo_spec("grpo")
    spec.update(output_dir=str(out / f"seed{ns.seed}"), seed=ns.seed, max_steps=ns.steps, ema_decay=ns.decays[0])
    spec.pop("time_budget_s", None)
    job, config, task, rewards, lora, ev, _ = prepare(spec)
    config.overwrite_output_dir = True
    fit_torch_threads()
    transformers.set_seed(config.seed)
    with no_progress_bars():
        tok = load_tokenizer(job["model"])
        model = load_model(job["model"], **config.model_init_kwargs)
    init_kwargs, config.model_init_kwargs = config.model_init_kwargs, None  # loaded already
    trainer = GRPOTrainer(model, rewards, args=config, train_dataset=task.train_dataset, processing_class=tok,
                          peft_config=lora_config(lora))
    config.model_init_kwargs = init_kwargs
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # one line per evaluation instead
    trainer.remove_callback(transformers.trainer_callback.ProgressCallback)
    records: list[dict] = []

    def accuracy(m) -> float:
        summary = evaluate(m, tok, task.eval_dataset, task.reward_funcs, accuracy_reward=task.accuracy_reward,
                           max_new_tokens=int(ev["max_new_tokens"]), greedy=True, n=ns.n)[0]
        return float(summary["accuracy"])

    class Probe(TrainerCallback):
        """Extra averages beside the trainer's; at every ``--every``-th step and the last, each one evaluated."""

        def __init__(self):
            self.extra: list[WeightAverage] = []

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.extra = [WeightAverage(model, d) for d in ns.decays[1:]]

        def on_step_end(self, args, state, control, model=None, **kw):
            for average in self.extra:
                average.update()
            step = state.global_step
            if step % ns.every and step != ns.steps:
                return
            row = {"step": step, "trained": accuracy(model)}
            with trainer.averaged_weights():
                row[f"ema{ns.decays[0]}"] = accuracy(model)
            for d, average in zip(ns.decays[1:], self.extra):
                with average.applied():
                    row[f"ema{d}"] = accuracy(model)
            records.append(row)
            print(" | ".join(f"{k} {v:.1%}" if k != "step" else f"step {v}" for k, v in row.items()), flush=True)

    trainer.add_callback(Probe())
    trainer.train()
    path = out / f"seed{ns.seed}.json"
    atomic_write_text(path, json.dumps({"steps": ns.steps, "decays": ns.decays, "evaluations": records}, indent=1))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
