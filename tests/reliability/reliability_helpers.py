"""Shared pieces of the reliability suite: tiny trainers, datasets, rewards and a guard that fails on any model load."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tiny.py

from runs import chat_dataset, varied_reward  # noqa: E402
from runs import run_args as make_args  # noqa: E402
from tiny import tiny_model, tiny_tokenizer  # noqa: E402


def make_trainer(out, reward=varied_reward, dataset=None, model_seed: int = 0, rollout_backend=None, *,
                 extra_part=None, **kw):
    """A trainer on the tiny model; ``extra_part``: one more checkpoint part (grpokit/run/checkpoint_parts.py), added the
    way a subclass adds one, e.g. to fail or stall inside a save."""
    from grpokit.trainer import GRPOTrainer

    class Trainer(GRPOTrainer):
        def checkpoint_parts(self):
            return super().checkpoint_parts() + ([extra_part] if extra_part is not None else [])

    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=model_seed)
    return Trainer(model, reward, args=make_args(out, **kw), train_dataset=dataset or chat_dataset(),
                   processing_class=tok, rollout_backend=rollout_backend)


class FaultyPart:
    """A checkpoint part whose save runs ``fault()`` (raise, stall) at the steps ``when(step)`` says."""

    checkpoint_file = "fault_injection.json"

    def __init__(self, fault, when):
        self.fault, self.when, self.trainer = fault, when, None

    def state_dict(self):
        if self.trainer is not None and self.when(self.trainer.state.global_step):
            self.fault()
        return {"saved": True}

    def load_state_dict(self, state):
        pass


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
