"""The embedded SmolLM2-135M trains for two steps with Unsloth's GSPO settings at a CPU-sized batch (slow)."""

import math

import pytest
import torch
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.slow


def ends_with_number(completions, **kw):
    texts = [c[0]["content"] for c in completions]
    return [1.0 if t.strip().rstrip(".").split()[-1:] and t.strip().rstrip(".").split()[-1].isdigit() else 0.0
            for t in texts]


def short_reply(completions, **kw):
    return [-len(c[0]["content"]) / 100.0 for c in completions]


def test_smollm2_two_steps_with_unsloth_gspo_settings(tmp_path):
    pytest.importorskip("bitsandbytes")
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {a} + {a + 1}?"}] for a in range(8)]})
    args = GRPOConfig(
        output_dir=str(tmp_path), importance_sampling_level="sequence", loss_type="dr_grpo", epsilon=3e-4,
        epsilon_high=4e-4, optim="adamw_8bit", max_prompt_length=1024, adam_beta1=0.9, adam_beta2=0.99,
        weight_decay=0.1, warmup_ratio=0.1, lr_scheduler_type="cosine", log_completions=False, max_grad_norm=0.1,
        temperature=0.9, report_to="none", learning_rate=5e-6,
        # CPU-sized: 4 completions per micro-step, 2 micro-steps per optimizer step, 16 new tokens.
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, max_completion_length=16,
        max_steps=2, logging_steps=1, save_strategy="no", gradient_checkpointing=False, use_cpu=True,
    )
    trainer = GRPOTrainer("smollm2-135m-instruct", [ends_with_number, short_reply], args=args, train_dataset=ds)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2
    for h in logs:
        assert math.isfinite(h["reward"]) and math.isfinite(h["loss"])
        assert "rewards/ends_with_number/mean" in h and "rewards/short_reply/mean" in h
        assert h["completions/mean_length"] > 0
    moved = sum(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert moved > 0
