"""The typed rollout batch: what flows from generation and scoring to the loss, and into a checkpoint.

:class:`RolloutBatch` holds one scored generation batch, or one micro-batch of it (rows in groups of
``num_generations``). :class:`RolloutBuffer` holds the micro-batches of the generation batch being trained on and
where the trainer stands in its schedule (``steps_per_generation × num_iterations`` micro-steps per generation).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from .vision.inputs import VisionInputs

logger = logging.getLogger("grpokit")


@dataclass
class RolloutBatch:
    """A scored generation batch (or micro-batch): left-padded prompts, right-padded completions, one advantage per
    row, and the log-probs the loss may need."""

    prompt_ids: torch.Tensor
    """(N, P) prompt tokens, left-padded."""
    prompt_mask: torch.Tensor
    """(N, P) 1 for prompt tokens, 0 for padding."""
    completion_ids: torch.Tensor
    """(N, C) completion tokens, right-padded."""
    completion_mask: torch.Tensor
    """(N, C) 1 for the completion's tokens (up to and including EOS; tool results included), 0 for padding and for
    rows ``mask_truncated_completions`` removes: what the forward attends to. The loss counts :attr:`loss_mask`."""
    advantages: torch.Tensor
    """(N,) one advantage per completion."""
    num_items_in_batch: torch.Tensor
    """() loss tokens of the whole generation batch on all ranks (the ``global_token_mean`` normaliser)."""
    old_logps: torch.Tensor | None = None
    """(N, C) log-probs under the policy that generated the batch, when it is not the one the loss runs: data reused
    over several steps, an asynchronous batch, or a Mixture-of-Experts sampler whose routes are replayed. None with
    :attr:`sampler_logps` set: the loss's own forward is the trainer's side of the sampler mismatch."""
    ref_logps: torch.Tensor | None = None
    """(N, C) log-probs under the reference model (``beta != 0``)."""
    sampler_logps: torch.Tensor | None = None
    """(N, C) the sampler's own log-probs of its tokens (vLLM, copies in another ``rollout_precision``)."""
    sampler_ratio: torch.Tensor | None = None
    """(N, C) or (N, 1) the engine/trainer mismatch ratio ``ρ``, where :attr:`old_logps` gave it (else the loss
    computes it from its own forward)."""
    tool_mask: torch.Tensor | None = None
    """(N, C) 0 on completion tokens the model did not generate (tool results): they are context for the forward but
    take no part in the loss, the entropy or the lengths."""
    sampler_routes: torch.Tensor | None = None
    """(N, P + C, L, k) a Mixture-of-Experts sampler's experts at every position of the rows (``grpokit.moe``)."""
    old_routes: torch.Tensor | None = None
    """(N, P + C, L, k) the experts the old log-probs' forward used (``routing_replay="old"``)."""
    vision: VisionInputs | None = None
    """The prompts' image tensors (a vision-language model's batch with images), one row per row: every forward of
    these rows gets them."""

    def __len__(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def loss_mask(self) -> torch.Tensor:
        """(N, C) the tokens the loss counts: the model's own completion tokens."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields that are set, by name (:attr:`vision` is not one: see :meth:`state`)."""
        return {f.name: v for f in dataclasses.fields(self)
                if f.name != "vision" and (v := getattr(self, f.name)) is not None}

    def select(self, rows: slice | torch.Tensor) -> RolloutBatch:
        """The rows ``rows`` (a slice, an index tensor or a boolean mask); batch-wide values (0-dim) are kept."""
        vision = None
        if self.vision is not None:
            if isinstance(rows, torch.Tensor):  # the images' rows as a list of indices
                vision = self.vision.select((rows.nonzero() if rows.dtype == torch.bool else rows).flatten().tolist())
            else:
                vision = self.vision.select(rows)
        return RolloutBatch(**{k: (v[rows] if v.dim() > 0 else v) for k, v in self.tensors().items()}, vision=vision)

    def split(self, parts: int) -> list[RolloutBatch]:
        """``parts`` micro-batches of equal size, in order."""
        n = len(self)
        if parts < 1 or n % parts:
            raise ValueError(f"generation batch of {n} rows does not split into steps_per_generation={parts} "
                             "micro-batches")
        size = n // parts
        return [self.select(slice(p * size, (p + 1) * size)) for p in range(parts)]

    def to(self, device: torch.device | str) -> RolloutBatch:
        return RolloutBatch(**{k: v.to(device) for k, v in self.tensors().items()},
                            vision=self.vision.to(device) if self.vision is not None else None)

    def state(self) -> dict[str, Any]:
        """Everything the batch holds, as tensors by name (the image tensors as ``vision/<name>``) and, for a batch
        with images, their layout (``vision_layout``, JSON values): what a checkpoint stores."""
        state: dict[str, Any] = dict(self.tensors())
        if self.vision is not None:
            state.update({f"vision/{k}": v for k, v in self.vision.tensors.items()})
            state["vision_layout"] = self.vision.layout()
        return state

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any]) -> RolloutBatch:
        """The inverse of :meth:`state` (and :meth:`tensors`); unknown names are an error (a checkpoint from another
        version)."""
        tensors = dict(tensors)
        layout = tensors.pop("vision_layout", None)
        images = {k.split("/", 1)[1]: tensors.pop(k) for k in [k for k in tensors if k.startswith("vision/")]}
        known = {f.name for f in dataclasses.fields(cls)} - {"vision"}
        unknown = set(tensors) - known
        if unknown:
            raise ValueError(f"rollout tensors {sorted(unknown)} are not fields of RolloutBatch ({sorted(known)})")
        if (layout is None) != (not images):
            raise ValueError("rollout image tensors and their layout must come together")
        return cls(**tensors, vision=VisionInputs.from_layout(images, layout) if layout is not None else None)


class RolloutBuffer:
    """The micro-batches of the current generation batch, and the trainer's micro-step counter.

    A generation batch is generated on micro-steps ``0, every, 2·every, ...`` (``every = steps_per_generation ×
    num_iterations``) and its ``steps_per_generation`` micro-batches are served in turn until the next one.

    A checkpoint part (:mod:`grpokit.run.checkpoint_parts`): when a checkpoint falls inside a generation batch, the
    micro-batches not consumed yet are saved with it, so a resumed run continues with the very same batches.
    """

    checkpoint_file = "grpokit_rollouts{suffix}.safetensors"

    def __init__(self, steps_per_generation: int, generate_every: int):
        self.steps_per_generation = steps_per_generation
        self.generate_every = generate_every
        self.parts: list[RolloutBatch] = []
        self.micro_step = 0
        self.device: torch.device | str = "cpu"

    def reset(self, micro_step: int, device: torch.device | str | None = None) -> None:
        """Start (or restart after a resume) at ``micro_step`` with nothing buffered; loaded batches go to
        ``device``."""
        self.parts = []
        self.micro_step = micro_step
        if device is not None:
            self.device = device

    def needs_generation(self) -> bool:
        return self.micro_step % self.generate_every == 0 or not self.parts

    def mid_generation(self) -> bool:
        """True when micro-batches of the current generation batch are still to be served (a checkpoint taken now
        must hold them to resume exactly)."""
        return bool(self.parts) and self.micro_step % self.generate_every != 0

    def fill(self, batch: RolloutBatch) -> None:
        self.parts = batch.split(self.steps_per_generation)

    def next(self) -> RolloutBatch:
        part = self.parts[self.micro_step % self.steps_per_generation]
        self.micro_step += 1
        return part

    def state_dict(self) -> dict[str, Any] | None:
        """Tensors (``"<part>/<field>"``) and the counts, or None on a generation boundary (nothing to save)."""
        if not self.mid_generation():
            return None
        state: dict[str, Any] = {"parts": len(self.parts), "micro_step": self.micro_step}
        for i, part in enumerate(self.parts):
            for key, value in part.state().items():  # the image tensors too: a resume trains on the same pictures
                state[f"{i}/{key}"] = value.detach().to("cpu").clone() if isinstance(value, torch.Tensor) else value
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.micro_step % self.generate_every == 0:
            return  # resumed on a generation boundary: the next batch is generated
        parts: list[dict[str, Any]] = [{} for _ in range(int(state.get("parts", 0)))]
        for name, value in state.items():
            if "/" in name:
                i, key = name.split("/", 1)
                on_device = isinstance(value, torch.Tensor) and not key.endswith("_routes")  # (recordings: the CPU)
                parts[int(i)][key] = value.to(self.device) if on_device else value
        self.parts = [RolloutBatch.from_tensors(p) for p in parts]

    def missing_from_checkpoint(self, path: str) -> None:
        if self.micro_step % self.generate_every != 0:
            logger.warning("checkpoint %s falls inside a generation batch and holds no saved rollouts: that batch is "
                           "generated again, so the resumed run is not step-for-step identical", os.path.dirname(path))
