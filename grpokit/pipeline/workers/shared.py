"""Memory a learner shares with its rollout workers: anonymous shared files (``memfd_create``) mapped as tensors, and a
pickler that puts an object's tensors into one of them instead of into the pickle.

An anonymous shared file has no name in any file system: it lives while a process holds its descriptor or a mapping
of it, so nothing is left behind however the processes end (a ``SIGKILL`` included). A worker is given the
descriptor when it is started (``pass_fds``) and maps it through ``/proc/self/fd``.
"""

from __future__ import annotations

import io
import os
from typing import Any

import dill
import torch

ALIGN = 64
"""Every tensor starts at a multiple of this many bytes (any dtype's alignment, a cache line)."""


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SharedFile:
    """``nbytes`` of anonymous shared memory, mapped as a flat uint8 tensor (:attr:`bytes`). Made by the learner
    (:meth:`create`); a worker maps the same memory from the inherited descriptor (:meth:`attach`)."""

    def __init__(self, fd: int, nbytes: int, owner: bool):
        self.fd, self.nbytes, self.owner = fd, nbytes, owner
        self.bytes = (torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
                      if nbytes else torch.empty(0, dtype=torch.uint8))

    @classmethod
    def create(cls, nbytes: int, name: str) -> SharedFile:
        fd = os.memfd_create(f"grpokit-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(nbytes, 1))
        return cls(fd, nbytes, owner=True)

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> SharedFile:
        return cls(fd, nbytes, owner=False)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` stored at byte ``offset``."""
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        return self.bytes[offset:offset + size].view(dtype).view(shape)

    def close(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


def _shareable(obj: Any) -> bool:
    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu" and not obj.is_sparse
            and not obj.is_quantized and obj.layout == torch.strided and obj.numel() > 0)


class _ArenaPickler(dill.Pickler):
    """Pickles tensors as references into an arena: (index, dtype, shape, is a Parameter, requires_grad); the same
    tensor object twice (tied weights) is one reference."""

    def __init__(self, file, tensors: list[torch.Tensor]):
        super().__init__(file, recurse=True)
        self.tensors, self._index = tensors, {}

    def persistent_id(self, obj):
        if not _shareable(obj):
            return None
        key = id(obj)
        if key not in self._index:
            self._index[key] = len(self.tensors)
            self.tensors.append(obj)
        return ("tensor", self._index[key], str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                isinstance(obj, torch.nn.Parameter), obj.requires_grad)


class _ArenaUnpickler(dill.Unpickler):
    def __init__(self, file, arena: SharedFile, offsets: list[int], private: bool):
        super().__init__(file)
        self.arena, self.offsets, self.private, self._made = arena, offsets, private, {}

    def persistent_load(self, pid):
        _, index, dtype, shape, is_param, requires_grad = pid
        if index not in self._made:
            t = self.arena.view(self.offsets[index], getattr(torch, dtype), shape)
            if self.private:
                t = t.clone()
            self._made[index] = torch.nn.Parameter(t, requires_grad=requires_grad) if is_param else t
        return self._made[index]


def dump_shared(obj: Any, name: str) -> tuple[bytes, SharedFile, list[int]]:
    """``obj`` pickled (``dill``) with its CPU tensors copied into one new shared file: (the pickle, the file, each
    tensor's byte offset in it)."""
    tensors: list[torch.Tensor] = []
    buffer = io.BytesIO()
    _ArenaPickler(buffer, tensors).dump(obj)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += aligned(t.numel() * t.element_size())
    arena = SharedFile.create(total, name)
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            arena.view(offset, t.dtype, tuple(t.shape)).copy_(t.detach().contiguous())
    return buffer.getvalue(), arena, offsets


def load_shared(blob: bytes, arena: SharedFile, offsets: list[int], private: bool = True) -> Any:
    """What :func:`dump_shared` pickled; its tensors are private copies (``private``) or views of the shared file."""
    return _ArenaUnpickler(io.BytesIO(blob), arena, offsets, private).load()
