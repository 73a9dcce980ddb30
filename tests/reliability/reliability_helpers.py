"""Shared pieces of the reliability suite: tiny trainers, datasets, rewards and a guard that fails on any model load."""

from __future__ import annotations

import os
import sys

import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tiny.py

from tiny import tiny_model, tiny_tokenizer  # noqa: E402

from grpokit.config import GRPOConfig  # noqa: E402


def chat_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(n)],
        "answer": [str(2 * i) for i in range(n)],
    })


def varied_reward(completions, **kw):
    """Distinct characters of the reply: spread within every group of random completions."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(set(t)) / 8.0 for t in texts]


def make_args(out, **kw) -> GRPOConfig:
    base = dict(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=2, logging_steps=1, report_to="none", gradient_checkpointing=False, learning_rate=1e-2,
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )
    base.update(kw)
    return GRPOConfig(**base)


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def make_trainer(out, reward=varied_reward, dataset=None, model_seed: int = 0, rollout_backend=None, **kw):
    from grpokit.trainer import GRPOTrainer

    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=model_seed)
    return GRPOTrainer(model, reward, args=make_args(out, **kw), train_dataset=dataset or chat_dataset(),
                       processing_class=tok, rollout_backend=rollout_backend)


class LoadGuard:
    """Replaces every model/tokenizer loading entry point; records calls and fails them."""

    def __init__(self, monkeypatch):
        import transformers

        import grpokit.models

        self.calls: list[str] = []

        def fail(name):
            def f(*a, **k):
                self.calls.append(name)
                raise AssertionError(f"{name} was called: a model was loaded before validation finished")
            return f

        monkeypatch.setattr(grpokit.models, "load_model", fail("grpokit.models.load_model"))
        monkeypatch.setattr(grpokit.models, "load_tokenizer", fail("grpokit.models.load_tokenizer"))
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail("AutoModelForCausalLM"))
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail("AutoTokenizer"))
