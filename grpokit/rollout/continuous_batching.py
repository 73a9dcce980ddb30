"""Rollouts with transformers' continuous-batching engine (``generate_batch``: paged attention, requests scheduled
as they finish, CUDA graphs on GPU) — TRL's ``use_transformers_continuous_batching``. The trainer's own model
samples, so there is no sampler/trainer mismatch and no weight sync; sampling parameters, EOS handling and the
returned :class:`Generation` are those of :class:`TransformersRollout`."""

from __future__ import annotations

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
        self.config = {"max_memory_percent": DEFAULT_MAX_MEMORY_PERCENT, **(config or {})}
        self._configs = TransformersRollout(tokenizer)  # the same GenerationConfig as the default backend

    def continuous_batching_config(self):
        from transformers.generation import ContinuousBatchingConfig

        return ContinuousBatchingConfig(**self.config)

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
                outputs = model.generate_batch(inputs, generation_config=config,
                                               continuous_batching_config=self.continuous_batching_config(),
                                               progress_bar=False)
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

    def sync_weights(self, model: torch.nn.Module) -> None:  # the sampler is the trainer's model itself
        return None
