"""Weights published to rollout workers through shared memory: :class:`WeightSlots`.

The learner publishes the trained tensors — every weight in full fine-tuning, the adapter's tensors alone with LoRA —
after an optimizer step; workers load the newest complete publication between batches. No byte goes through a
pipe: one copy into shared memory by the learner, one copy out by each worker.

Two slots, each guarded by a sequence counter (a seqlock). The learner writes into the slot holding the older
version: it makes the counter odd, copies, sets the version and makes the counter even again. A worker reads the
complete slot with the newest version, and checks after copying that the counter did not move; if it did (the
learner started overwriting that slot meanwhile, two publications later), it reads again. A publication torn
mid-write (the learner killed during the copy) leaves its counter odd, and no worker ever loads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .shared import ALIGN, SharedFile, aligned

HEADER = 2 * ALIGN
"""Per slot, 64 bytes: its sequence counter and the version it holds (int64 each)."""
EMPTY = -1


class TornPublication(RuntimeError):
    """A read kept meeting writes (it could not get a consistent copy in many tries)."""


class WeightSlots:
    """Two publication slots for the tensors named in ``layout`` ((name, dtype, shape) in a fixed order)."""

    def __init__(self, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], shared: SharedFile):
        self.layout, self.shared = layout, shared
        self.offsets, size = [], 0
        for _, dtype, shape in layout:
            self.offsets.append(size)
            size += aligned(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size())
        self.slot_bytes = size
        self.header = shared.bytes[:HEADER].view(torch.int64).view(2, ALIGN // 8)

    @staticmethod
    def nbytes(layout) -> int:
        per_slot = sum(aligned(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size()) for _, d, s in layout)
        return HEADER + 2 * per_slot

    @classmethod
    def create(cls, tensors: dict[str, torch.Tensor]) -> WeightSlots:
        """Empty slots for tensors like ``tensors`` (the learner's)."""
        layout = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
        slots = cls(layout, SharedFile.create(cls.nbytes(layout), "weights"))
        slots.header[:, 0] = 0
        slots.header[:, 1] = EMPTY
        return slots

    @classmethod
    def attach(cls, layout, fd: int) -> WeightSlots:
        return cls(layout, SharedFile.attach(fd, cls.nbytes(layout)))

    @property
    def bytes_per_publication(self) -> int:
        """The bytes one publication copies (the tensors themselves, without alignment)."""
        return sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for _, d, s in self.layout)

    def _tensors(self, slot: int) -> list[torch.Tensor]:
        base = HEADER + slot * self.slot_bytes
        return [self.shared.view(base + off, dtype, shape) for off, (_, dtype, shape) in zip(self.offsets, self.layout)]

    def versions(self) -> list[int]:
        """Each slot's version; -1 for one empty or being written."""
        return [int(v) if int(s) % 2 == 0 else EMPTY for s, v in self.header[:, :2].tolist()]

    # -- the learner -----------------------------------------------------------------------------------------------
    def write(self, version: int, tensors: dict[str, torch.Tensor],
              copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Publish ``tensors`` (by name, as in the layout) as ``version``, into the slot holding the older one.
        ``copy(destination, source)``: how each tensor is copied (a test tears a publication with it)."""
        versions = self.versions()  # a slot torn mid-write counts as empty: the one overwritten first
        slot = 0 if versions[0] <= versions[1] else 1
        sequence = int(self.header[slot, 0])
        self.header[slot, 0] = sequence + 1 if sequence % 2 == 0 else sequence + 2  # odd: being written (a torn
        # earlier write left it odd: it stays so)
        with torch.no_grad():
            for (name, _, _), dest in zip(self.layout, self._tensors(slot)):
                (copy or torch.Tensor.copy_)(dest, tensors[name].detach())
        self.header[slot, 1] = version
        self.header[slot, 0] += 1  # even: complete

    # -- a worker ----------------------------------------------------------------------------------------------------
    def read(self, into: dict[str, torch.Tensor], newer_than: int, tries: int = 1000) -> int | None:
        """Copy the newest complete publication into ``into`` (by name) if its version is above ``newer_than``;
        its version, or None when there is none newer."""
        for _ in range(tries):
            sequences, versions = zip(*self.header[:, :2].tolist())
            complete = [(v, i) for i, (s, v) in enumerate(zip(sequences, versions)) if s % 2 == 0 and v != EMPTY]
            if not complete:
                return None
            version, slot = max(complete)
            if version <= newer_than:
                return None
            with torch.no_grad():
                for (name, _, _), source in zip(self.layout, self._tensors(slot)):
                    into[name].copy_(source)
            if int(self.header[slot, 0]) == sequences[slot]:
                return version
        raise TornPublication(f"weights could not be read consistently in {tries} tries (published faster than read)")

    def close(self) -> None:
        self.shared.close()
