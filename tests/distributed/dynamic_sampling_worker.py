"""Worker for the two-process dynamic-sampling test: trains a tiny model for two steps with dynamic_sampling on,
two of three prompts always scoring alike, and writes what every generation batch held to OUT/rank<r>.pt."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from tiny import tiny_model, tiny_tokenizer  # noqa: E402

from grpokit.config import GRPOConfig  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402


def reward(completions, hard, **kw):
    return [0.0 if h else len(set(c[0]["content"])) / 8 for c, h in zip(completions, hard)]


def main(out: str) -> None:
    tok = tiny_tokenizer()
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(48)],
                            "hard": [i % 3 != 0 for i in range(48)]})
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
                      max_steps=2, logging_steps=1, report_to="none", gradient_checkpointing=False,
                      save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-2,
                      dynamic_sampling=True, dynamic_sampling_max_rounds=10)
    trainer = GRPOTrainer(tiny_model(tok), reward, args=args, train_dataset=ds, processing_class=tok)
    seen = []
    finish = trainer.pipeline.finish

    def record(s, stats, driver, mode="train", behaviour_logps=None):
        seen.append({"prompts": [p[0]["content"] for p in s.prompts], "rewards": s.rewards.clone()})
        batch, stats = finish(s, stats, driver, mode, behaviour_logps)
        seen[-1]["advantages"] = batch.advantages.clone()
        return batch, stats

    trainer.pipeline.finish = record
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    torch.save({"seen": seen, "logs": logs, "refill_position": trainer.pipeline.prompts.refill_position},
               os.path.join(out, f"rank{trainer.args.process_index}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    from grpokit.bounds.process_group import exit_process

    exit_process(0)  # a finished gloo collective must not meet the interpreter's teardown
