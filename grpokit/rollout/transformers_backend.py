"""Rollouts with transformers' ``generate``: batched, KV cache, left-padded prompts, the trainer's own weights
(so no sampler/trainer mismatch and no weight sync)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from .base import RolloutBatch, SamplingParams, completion_mask_from_eos


def _eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.extend(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def _merge_lora(model: torch.nn.Module) -> bool:
    """Fold LoRA adapters into the base weights for the duration of generation: one matmul per layer instead of
    three, ~25% less rollout time for SmolLM2 with r=16 on all linear layers. Unmerged right after."""
    if hasattr(model, "merge_adapter") and getattr(model, "peft_config", None) and not getattr(model, "merged", False):
        model.merge_adapter()
        return True
    return False


class TransformersRollout:
    """The default backend. ``generate`` runs in eval mode under ``no_grad`` and restores the training mode."""

    def __init__(self, tokenizer, max_batch_size: int | None = None):
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size

    def generation_config(self, model: torch.nn.Module, params: SamplingParams) -> GenerationConfig:
        eos = _eos_ids(model, self.tokenizer)
        kwargs = dict(
            max_new_tokens=params.max_new_tokens,
            do_sample=params.do_sample,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=eos,
            use_cache=True,
        )
        if params.do_sample:
            kwargs.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k else None,
                min_p=params.min_p,
                repetition_penalty=params.repetition_penalty,
            )
        elif params.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = params.repetition_penalty
        kwargs.update(params.extra)
        return GenerationConfig(**kwargs)

    @torch.no_grad()
    def generate(
        self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> RolloutBatch:
        config = self.generation_config(model, params)
        was_training = model.training
        model.eval()
        merged = _merge_lora(model)
        try:
            step = self.max_batch_size or prompt_ids.shape[0]
            chunks = []
            for start in range(0, prompt_ids.shape[0], step):
                ids, mask = prompt_ids[start:start + step], prompt_mask[start:start + step]
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                chunks.append(out[:, ids.shape[1]:])
        finally:
            if merged:
                model.unmerge_adapter()
            model.train(was_training)
        width = max(c.shape[1] for c in chunks)
        pad = self.tokenizer.pad_token_id
        completion_ids = torch.cat(
            [torch.nn.functional.pad(c, (0, width - c.shape[1]), value=pad) for c in chunks], 0
        )
        mask, truncated = completion_mask_from_eos(completion_ids, config.eos_token_id)
        completion_ids = completion_ids.masked_fill(mask == 0, pad)
        return RolloutBatch(completion_ids=completion_ids, completion_mask=mask, is_truncated=truncated)

    def sync_weights(self, model: torch.nn.Module) -> None:  # the sampler is the trainer's model itself
        return None
