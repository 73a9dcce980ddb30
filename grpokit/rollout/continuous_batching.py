"""Rollouts with transformers' continuous-batching engine (``generate_batch``: paged attention, requests scheduled
as they finish, CUDA graphs on GPU) — TRL's ``use_transformers_continuous_batching``. The trainer's own model
samples, so there is no sampler/trainer mismatch and no weight sync; sampling parameters, EOS handling and the
returned :class:`Generation` are those of :class:`TransformersRollout`.

On a CPU the engine's KV cache is sized for the call (every row's prompt and new tokens) unless the config sets its
size itself: left to size it by memory, transformers reserves a share of free RAM and zero-fills it on every call
(gigabytes and seconds of work for a tiny model's four 12-token completions: benchmarks/RESULTS.md, 'Measurements
behind design choices')."""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Generation, SamplingParams, completion_mask_from_eos
from .transformers_backend import TransformersRollout, lora_merged

DEFAULT_MAX_MEMORY_PERCENT = 0.5
"""transformers' engine reserves 90% of free GPU memory for its KV cache by default, which leaves nothing for the
training step: grpokit (as TRL) asks for half unless ``transformers_continuous_batching_config`` says otherwise."""


class ContinuousBatchingRollout:
    holds_weights = False

    def __init__(self, tokenizer, config: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.user_config = dict(config or {})
        self.config = {"max_memory_percent": DEFAULT_MAX_MEMORY_PERCENT, **self.user_config}
        self._configs = TransformersRollout(tokenizer)  # the same GenerationConfig as the default backend

    def continuous_batching_config(self, device: torch.device | None = None, prompt_lengths: list[int] | None = None,
                                   max_new_tokens: int = 0):
        """The engine's config: the user's (``transformers_continuous_batching_config``) over grpokit's default; on a
        CPU, for a call with ``prompt_lengths`` and ``max_new_tokens``, a cache of what the call needs (every row's
        prompt and new tokens, one page more per row) where the user set neither its size nor its share of memory
        (``num_blocks``, ``max_memory_percent``), and batches of at most all the prompts' tokens where the user did
        not set ``max_batch_tokens``."""
        from transformers.generation import ContinuousBatchingConfig

        config = dict(self.config)
        if device is not None and device.type == "cpu" and prompt_lengths:
            page = int(config.get("page_size") or ContinuousBatchingConfig.page_size)
            if not {"num_blocks", "max_memory_percent"} & self.user_config.keys():
                per_row = math.ceil((max(prompt_lengths) + max_new_tokens) / page) + 1
                config["num_blocks"] = len(prompt_lengths) * per_row
            if "max_batch_tokens" not in self.user_config:
                config["max_batch_tokens"] = min(8192, max(sum(prompt_lengths), max(prompt_lengths) + 1))
        return ContinuousBatchingConfig(**config)

    def generation_batch(self, model: torch.nn.Module):
        """As :meth:`TransformersRollout.generation_batch`: one merge of the adapter for a batch's calls."""
        return lora_merged(model)

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams) -> Generation:
        if params.lockstep:
            raise ValueError("use_transformers_continuous_batching cannot generate on sharded weights in lockstep; "
                             "set ds3_gather_for_generation=True or use the default generation")
        config = self._configs.generation_config(model, params)
        inputs = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        was_training = model.training
        model.eval()
        try:
            with lora_merged(model):
                cb_config = self.continuous_batching_config(getattr(model, "device", prompt_ids.device),
                                                            [len(r) for r in inputs], params.max_new_tokens)
                outputs = model.generate_batch(inputs, generation_config=config,
                                               continuous_batching_config=cb_config, progress_bar=False)
        finally:
            model.train(was_training)
        tokens = [outputs[f"req_{i}"].generated_tokens for i in range(len(inputs))]
        width = max(1, max((len(t) for t in tokens), default=0))
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(tokens), width), pad, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        ids = ids.to(prompt_ids.device)
        mask, truncated = completion_mask_from_eos(ids, config.eos_token_id)
        empty = torch.tensor([len(t) == 0 for t in tokens], device=ids.device)
        mask = mask.masked_fill(empty.unsqueeze(1), 0)
        return Generation(completion_ids=ids.masked_fill(mask == 0, pad), completion_mask=mask,
                          is_truncated=truncated | empty)

    def sync_weights(self, model: torch.nn.Module, step: int | None = None) -> None:  # the sampler is the trainer's model itself
        return None
