"""The rollout interface: a backend turns tokenised prompts into sampled completions.

A backend gets left-padded prompts (one row per completion to sample, the ``G`` rows of a prompt consecutive)
and returns right-padded completions with their masks. Backends whose sampler differs from the trainer (vLLM)
also return the sampler's per-token log-probs so the trainer can correct the mismatch (docs/algorithms.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    do_sample: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    """Backend-specific keyword arguments (TRL's ``generation_kwargs``); they override the fields above."""
    lockstep: bool = False
    """Every rank must run the same forwards (training shards the weights and they were not gathered, see
    ``grpokit.forward.sharding``): the transformers backend generates with ``synced_gpus=True`` and no shared prefill."""
    record_routes: bool = False
    """A Mixture-of-Experts policy: record the experts its routers choose (:attr:`Generation.prompt_routes`), where
    the backend can (grpokit's transformers backend)."""


@dataclass
class PromptBatch:
    """The prompts of one generation call, as every sampling path hands them on (the pipeline, the drivers, the
    tool loop, a rollout worker): left-padded ``ids`` (N, P) and ``mask``, and for a vision-language model's batch
    with images ``vision`` (the rows' :class:`grpokit.vision.VisionInputs`) and ``images`` (per row, its PIL
    images). A backend gets them as its arguments (:meth:`backend_kwargs`)."""

    ids: torch.Tensor
    mask: torch.Tensor
    vision: Any = None
    images: list[list] | None = None

    def backend_kwargs(self) -> dict[str, Any]:
        """What a backend's ``generate`` gets besides the ids and mask: the image tensors and images, only for a
        batch with images (backends without image support, and test fakes, never see them otherwise)."""
        return {} if self.vision is None else {"vision": self.vision, "images": self.images}


@dataclass
class Generation:
    """What a backend returns for a batch of prompts (before scoring; see ``grpokit.batch.RolloutBatch`` for the
    scored batch the trainer trains on)."""

    completion_ids: torch.Tensor
    """(N, C) sampled tokens, right-padded with the pad id after the first EOS (the EOS itself is kept)."""
    completion_mask: torch.Tensor
    """(N, C) 1 for real completion tokens (up to and including the EOS), 0 for padding."""
    is_truncated: torch.Tensor
    """(N,) True where no EOS was produced within ``max_new_tokens``."""
    sampler_logps: torch.Tensor | None = None
    """(N, C) log-probs of the sampled tokens under the sampler, when it is not the trainer's model."""
    tool_mask: torch.Tensor | None = None
    """(N, C) 1 for tokens the model generated, 0 for tokens it did not (tool results of a multi-turn rollout);
    None when every valid token is the model's."""
    messages: list | None = None
    """Per row, the completion as chat messages (a multi-turn rollout's replies and tool turns); None: decode it."""
    prompt_routes: torch.Tensor | None = None
    """(N, P, L, k) a Mixture-of-Experts sampler's experts at each prompt position (``grpokit.moe.recording``), when
    recorded; :attr:`completion_routes` (N, C, L, k) at each completion position."""
    completion_routes: torch.Tensor | None = None


class RolloutBackend(Protocol):
    holds_weights: bool
    """True for an engine with its own copy of the weights (vLLM): the trainer gathers sharded weights whole for
    :meth:`sync_weights` and does not hand it a model for generation. False (or absent): ``generate`` runs the
    trainer's model."""

    def generate(
        self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> Generation: ...
    # A backend for vision-language models also takes ``vision`` (the rows' image tensors,
    # ``grpokit.vision.VisionInputs``) and ``images`` (per row, its PIL images) as keyword arguments; the trainer
    # passes them only for rows with images.

    def sync_weights(self, model: torch.nn.Module, step: int | None = None) -> None:
        """Called after every optimizer step; a backend holding its own copy of the weights refreshes it. ``step``:
        the training step the weights are from (an error names it)."""
        ...

    # Optional: ``generation_batch(model)``, a context manager the trainer enters around every generation call of one
    # batch (dynamic sampling's rounds, tool turns), for work a backend would otherwise repeat per call.


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask every token after the first EOS (the EOS stays in). Returns ``(mask, is_truncated)``."""
    n, c = completion_ids.shape
    if c == 0:
        return completion_ids.new_zeros((n, 0)), torch.ones(n, dtype=torch.bool, device=completion_ids.device)
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= completion_ids == e
    has_eos = is_eos.any(1)
    first = torch.where(has_eos, is_eos.int().argmax(1), torch.full_like(has_eos, c, dtype=torch.long))
    positions = torch.arange(c, device=completion_ids.device).expand(n, -1)
    mask = (positions <= first.unsqueeze(1)).long()
    return mask, ~has_eos


def stop_token_ids(model: torch.nn.Module | None, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the model's (generation config and config).
    ``tokenizer`` may be a processor (its tokenizer's EOS)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.extend(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def context_length(model: torch.nn.Module | None) -> int | None:
    """The most positions the model takes (its config's ``max_position_embeddings``), when it says."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "max_position_embeddings", None)
