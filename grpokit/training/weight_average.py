"""An exponential moving average of the trained weights (``GRPOConfig.ema_decay``).

After every optimizer step ``t`` (1, 2, ...) the average ``W̄`` of each trained parameter ``W`` (the adapter's with
LoRA) moves toward it, ``W̄ ← d_t · W̄ + (1 − d_t) · W`` with ``d_t = min(decay, (1 + t) / (10 + t))`` (the formula and
its pure functions: :mod:`grpokit.algorithms.averaging`). This module keeps the state: ``W̄`` in float32 whatever the
parameter's dtype, its swap into the model, its checkpoint file. Training itself follows ``W``; the
average is what the run delivers: the trainer copies it into the model when training ends (not when it is
interrupted: a checkpoint holds both, and a resumed run goes on from ``W``), and a job's held-out evaluations
during training measure it. It smooths the step-to-step swings of a policy trained at a high learning rate
(docs/demo.md, "Weight averaging").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..algorithms.averaging import ema_decay_at, mix_

WEIGHT_AVERAGE_FILE = "grpokit_weight_average.safetensors"
_UPDATES_KEY = "updates"


class WeightAverage:
    """The moving average of ``model``'s trainable parameters (those with ``requires_grad`` when it is made)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = float(decay)
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("ema_decay is set but the model has no trainable parameters to average")
        self.average = {name: p.detach().float().clone() for name, p in self.params.items()}
        self.updates = 0

    def update(self) -> None:
        """One step of the average toward the current weights."""
        self.updates += 1
        mix_(self.average.values(), self.params.values(), 1.0 - ema_decay_at(self.decay, self.updates))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Give the model the averaged weights (each parameter in its own dtype)."""
        for name, p in self.params.items():
            p.copy_(self.average[name])

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model for the block; the trained ones back after it, bit for bit."""
        with torch.no_grad():
            saved = {name: p.detach().clone() for name, p in self.params.items()}
        self.copy_to_model()
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(saved[name])

    # -- a checkpoint part (grpokit/run/checkpoint_parts.py) ------------------------------------------------------------
    checkpoint_file = WEIGHT_AVERAGE_FILE

    def state_dict(self) -> dict[str, Any]:
        """The average, its update count and decay."""
        return {**{name: a for name, a in self.average.items()}, _UPDATES_KEY: self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A saved average; one of other parameters (another model or adapter) is refused."""
        loaded = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        if set(loaded) != set(self.average):
            raise ValueError("it does not hold this model's trained parameters (another model or adapter?)")
        with torch.no_grad():
            for name, value in loaded.items():
                self.average[name].copy_(value)
        self.updates = int(state.get(_UPDATES_KEY, 0))


def start_weight_average(decay: float | None, model: torch.nn.Module, sharding: str | None) -> WeightAverage | None:
    """``ema_decay``'s average of ``model`` (unwrapped), starting from its weights as they are (a resume then loads
    the saved one); None without ``ema_decay``. Not under FSDP / ZeRO-3 (``sharding``), where each process holds only
    a shard of the weights."""
    if decay is None:
        return None
    if sharding is not None:
        name = "FSDP" if sharding.startswith("fsdp") else "DeepSpeed ZeRO-3"
        raise ValueError(f"ema_decay={decay!r} is not supported with {name} yet (each process holds only a shard of "
                         "the weights); use DDP or ZeRO-1/2, or leave ema_decay at None")
    return WeightAverage(model, decay)
