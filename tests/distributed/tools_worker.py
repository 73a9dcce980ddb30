"""Worker for the two-process tools test: trains a tiny model for two steps with a counter environment (its own
instances on every rank) and a tool, and writes each rank's prompts, rewards, logs and final weights to
OUT/rank<r>.pt."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from scripted_tools import Counter, ScriptedBackend, add, used_tool  # noqa: E402
from tiny import tiny_model, tiny_tokenizer  # noqa: E402

from grpokit.config import GRPOConfig  # noqa: E402
from grpokit.tools import CHATML_TOOLS_TEMPLATE  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402

CALL = '<tool_call>{"name": "increment", "arguments": {"by": 5}}</tool_call>'


def main(out: str) -> None:
    tok = tiny_tokenizer()
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Go {i}."}] for i in range(16)],
                            "target": [5] * 16})
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=200,
                      max_steps=2, logging_steps=1, report_to="none", gradient_checkpointing=False,
                      save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-2)
    backend = ScriptedBackend(tok, first=lambda i: CALL if i % 2 == 0 else "no")
    trainer = GRPOTrainer(tiny_model(tok, max_positions=2048), used_tool, args=args, train_dataset=ds,
                          processing_class=tok, tools=[add], environment_factory=Counter, rollout_backend=backend)
    seen = []
    finish = trainer.pipeline.finish

    def record(s, stats, driver, mode="train", behaviour_logps=None):
        seen.append({"prompts": [p[0]["content"] for p in s.prompts], "rewards": s.rewards.clone(),
                     "environments": [id(e) for e in trainer.multiturn.environments.pool[None]]})
        return finish(s, stats, driver, mode, behaviour_logps)

    trainer.pipeline.finish = record
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save({"seen": seen, "logs": logs, "weights": weights},
               os.path.join(out, f"rank{trainer.args.process_index}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    from grpokit.bounds.process_group import exit_process

    exit_process(0)  # a finished gloo collective must not meet the interpreter's teardown
