"""Worker for the two-process vision test: trains a tiny Qwen2-VL for two steps on every rank, twice — on a dataset
where every prompt has a picture, then on one where one rank's batches are text only (the vision tower gets no
gradient there, which DDP must be told: ``ddp_find_unused_parameters``) — and writes each rank's initial and final
weights, logs and the pictures its rewards saw to OUT/<scenario>_rank<r>.pt."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datasets import Dataset  # noqa: E402
from PIL import Image  # noqa: E402
from tiny_vlm import tiny_vlm  # noqa: E402

from grpokit.config import GRPOConfig  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402

COLOURS = ["red", "green", "blue", "white", "black", "yellow", "purple", "orange"]


def dataset(mixed: bool) -> Dataset:
    """Eight questions about eight pictures; ``mixed``: prompts 2, 3, 6 and 7 (rank 1's, in order, two prompts a rank
    and step) without one."""
    images = [Image.new("RGB", (32 + 8 * (i % 2), 32), c) for i, c in enumerate(COLOURS)]
    if mixed:
        images = [img if (i // 2) % 2 == 0 else None for i, img in enumerate(images)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Colour {i}?"}] for i in range(8)],
                              "image": images})


def train(out: str, scenario: str, mixed: bool) -> None:
    seen = []

    def reward(completions, image, **kw):
        seen.append([img.getpixel((0, 0)) if img is not None else None for img in image])
        return [len(set(c[0]["content"])) / 8 for c in completions]

    model, processor = tiny_vlm("qwen2_vl")
    args = GRPOConfig(output_dir=os.path.join(out, scenario), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, max_steps=2, logging_steps=1, report_to="none",
                      gradient_checkpointing=False, save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                      learning_rate=0.05, shuffle_dataset=False)
    trainer = GRPOTrainer(model, reward, args=args, train_dataset=dataset(mixed), processing_class=processor)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save({"before": before, "after": after, "logs": logs, "seen": seen,
                "find_unused": trainer.args.ddp_find_unused_parameters},
               os.path.join(out, f"{scenario}_rank{trainer.args.process_index}.pt"))


if __name__ == "__main__":
    train(sys.argv[1], "images", False)
    train(sys.argv[1], "mixed", True)  # rank 1's batches are text only
    from grpokit.bounds.process_group import exit_process

    exit_process(0)  # a finished gloo collective must not meet the interpreter's teardown
