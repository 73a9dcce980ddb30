"""Worker for the multi-process tests: trains a tiny model for two optimizer steps with a rollout backend whose
completions depend only on (generation call, global row), so any split over ranks sees the same data.

Run under ``torchrun --nproc_per_node N`` or in-process (one rank). Writes, per loss type, the final parameters
and the advantages of every generation batch to ``OUT/<loss>-rank<r>.pt``.

    python ddp_worker.py OUT PER_DEVICE GA LOSS[,LOSS...] [--fail-rank R]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from tiny import tiny_model, tiny_tokenizer  # noqa: E402

from grpokit.config import GRPOConfig  # noqa: E402
from grpokit.rollout.base import RolloutBatch, completion_mask_from_eos  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402

COMPLETION_LEN = 8


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class GlobalRowRollout:
    """Completions are a pure function of (call number, global row index)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0

    def generate(self, model, prompt_ids, prompt_mask, params):
        rank, _ = rank_and_world()
        n = prompt_ids.shape[0]
        rows = []
        for i in range(n):
            g = torch.Generator().manual_seed(1000 * self.calls + rank * n + i)
            ids = torch.randint(10, len(self.tokenizer), (COMPLETION_LEN,), generator=g)
            stop = int(torch.randint(2, COMPLETION_LEN + 2, (1,), generator=g))
            if stop < COMPLETION_LEN:
                ids[stop] = self.tokenizer.eos_token_id
            rows.append(ids)
        self.calls += 1
        ids = torch.stack(rows)
        mask, truncated = completion_mask_from_eos(ids, [self.tokenizer.eos_token_id])
        return RolloutBatch(ids.masked_fill(mask == 0, self.tokenizer.pad_token_id), mask, truncated)

    def sync_weights(self, model):
        pass


def reward(completions, **kw):
    return [len(set(c[0]["content"])) / 8.0 for c in completions]


def failing_reward(fail_rank):
    def boom(completions, **kw):
        if rank_and_world()[0] == fail_rank:
            raise RuntimeError(f"deliberate failure on rank {fail_rank}")
        return reward(completions)

    return boom


def run(out_dir: str, per_device: int, ga: int, loss_types: list[str], fail_rank: int | None = None,
        num_generations: int = 4) -> None:
    tok = tiny_tokenizer()
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"q{i} + {i}"}] for i in range(32)]})
    for loss_type in loss_types:
        model = tiny_model(tok, seed=7)
        args = GRPOConfig(
            output_dir=os.path.join(out_dir, f"run-{loss_type}"), per_device_train_batch_size=per_device,
            gradient_accumulation_steps=ga, num_generations=num_generations, max_completion_length=COMPLETION_LEN,
            max_steps=2, loss_type=loss_type, optim="sgd", learning_rate=0.5, max_grad_norm=0.0,
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, shuffle_dataset=False,
            gradient_checkpointing=False, disable_tqdm=True, seed=0, ddp_timeout=60,
        )
        rewards = [reward if fail_rank is None else failing_reward(fail_rank)]
        trainer = GRPOTrainer(model, rewards, args=args, train_dataset=ds, processing_class=tok,
                              rollout_backend=GlobalRowRollout(tok))
        advantages = []
        original = trainer._generate_and_score

        def recording(rows, mode):
            batch = original(rows, mode)
            advantages.append(batch["advantages"].detach().clone())
            return batch

        trainer._generate_and_score = recording
        trainer.train()
        rank, _ = rank_and_world()
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({
            "params": {k: v.detach().cpu().clone() for k, v in unwrapped.state_dict().items()},
            "advantages": advantages,
            "logs": trainer.state.log_history,
        }, os.path.join(out_dir, f"{loss_type}-rank{rank}.pt"))


if __name__ == "__main__":
    fail = None
    argv = sys.argv[1:]
    if "--fail-rank" in argv:
        i = argv.index("--fail-rank")
        fail = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    num_generations = 4
    if "--num-generations" in argv:
        i = argv.index("--num-generations")
        num_generations = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    run(argv[0], int(argv[1]), int(argv[2]), argv[3].split(","), fail, num_generations)
