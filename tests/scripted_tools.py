"""Pieces the tool tests share (single-process and two-process): a rollout backend with scripted replies, a
documented tool, a reward that sees tool turns, and a counter environment."""

from __future__ import annotations

import torch
from datasets import Dataset
from tiny import tiny_tokenizer

from grpokit.config import GRPOConfig
from grpokit.rollout.base import Generation, completion_mask_from_eos
from grpokit.tools import CHATML_TOOLS_TEMPLATE


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class ScriptedBackend:
    """A rollout backend whose replies are scripted by turn (the first reply of even rows calls ``add``); the tokens
    are real, so the trainer's forward and loss run on them."""

    holds_weights = False

    def __init__(self, tok, first=None, later="Answer: 5"):
        self.tok, self.calls = tok, 0
        self.first = first or (lambda i: '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
                               if i % 2 == 0 else f"I think {i}")
        self.later = later

    def generate(self, model, ids, mask, params):
        texts = [self.first(i) if self.calls % 2 == 0 else self.later for i in range(ids.shape[0])]
        self.calls += 1
        rows = [self.tok(t, add_special_tokens=False)["input_ids"][:params.max_new_tokens - 1] + [self.tok.eos_token_id]
                for t in texts]
        width = max(map(len, rows))
        out = torch.full((len(rows), width), self.tok.pad_token_id)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r)
        m, trunc = completion_mask_from_eos(out, [self.tok.eos_token_id])
        return Generation(out.masked_fill(m == 0, self.tok.pad_token_id), m, trunc)

    def sync_weights(self, model, step=None):
        pass


def used_tool(completions, **kw):
    """1 when the conversation holds a tool result, else 0."""
    return [1.0 if any(m["role"] == "tool" for m in c) else 0.0 for c in completions]



class Counter:
    """A counter the model increments toward a target it is told at reset."""

    def reset(self, **row):
        self.value, self.target = 0, int(row["target"])
        return f" Reach {self.target}."

    def increment(self, by: int) -> int:
        """Increase the counter.

        Args:
            by: how much to add
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0


def tokenizer(template=CHATML_TOOLS_TEMPLATE):
    """The tiny tokenizer with a tool-capable chat template."""
    tok = tiny_tokenizer()
    tok.chat_template = template
    return tok


def args_for(tmp_path, **kw) -> GRPOConfig:
    """A two-step CPU config for tool runs (completion budget for a call, its result and an answer)."""
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=200, max_steps=2, logging_steps=1, report_to="none",
                gradient_checkpointing=False, learning_rate=1e-2, save_strategy="no", use_cpu=True, disable_tqdm=True)
    base.update(kw)
    return GRPOConfig(**base)


def dataset(n=8) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is 2 + 3? ({i})"}] for i in range(n)]})
