"""What the trainer tests share: tiny datasets, a reward with spread in every group of random completions, the
settings of a short CPU run on the tiny model (tests/tiny.py), and small readers of a finished run."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from datasets import Dataset

from grpokit.config import GRPOConfig


def chat_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(n)],
        "answer": [str(2 * i) for i in range(n)],
    })


def text_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(n)], "answer": [str(i) for i in range(n)]})


def varied_reward(completions, **kw):
    """Distinct characters of the reply: spread within every group of random completions."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(set(t)) / 8.0 for t in texts]


def run_args(output_dir: str | Path, **kw) -> GRPOConfig:
    """A short run on the CPU: 4 rows × 4 generations, 8 tokens, 2 steps, a log line a step, no checkpoints."""
    base = dict(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=2, logging_steps=1, report_to="none", gradient_checkpointing=False, learning_rate=1e-2,
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )
    base.update(kw)
    return GRPOConfig(**base)


def make_args(tmp_path: Path, **kw) -> GRPOConfig:
    """:func:`run_args` writing into ``tmp_path / "out"``."""
    return run_args(Path(tmp_path) / "out", **kw)


def train_logs(trainer) -> list[dict]:
    """The log lines of training steps (those with a reward)."""
    return [h for h in trainer.state.log_history if "reward" in h]


def params_of(model, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad or not trainable_only}



@contextlib.contextmanager
def first_loss_inputs(trainer):
    """While in the block (a ``trainer.train()``), the first call of ``GRPOTrainer.compute_loss`` is recorded into
    the dict yielded: ``batch``, the micro-batch it took, and what it handed the policy loss (its keyword arguments,
    with ``logps`` detached and ``old_logps``)."""
    import grpokit.trainer as module

    seen: dict = {}
    real_loss, real_compute = module.policy_loss, trainer.compute_loss

    def recording(logps, old_logps, advantages, mask, settings, **kw):
        if "logps" not in seen:
            seen.update(kw, logps=logps.detach(), old_logps=old_logps)
        return real_loss(logps, old_logps, advantages, mask, settings, **kw)

    def compute_loss(model, inputs, *args, **kw):
        seen.setdefault("batch", inputs)
        return real_compute(model, inputs, *args, **kw)

    module.policy_loss, trainer.compute_loss = recording, compute_loss
    try:
        yield seen
    finally:
        module.policy_loss = real_loss
        del trainer.compute_loss
