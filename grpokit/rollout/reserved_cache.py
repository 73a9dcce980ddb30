"""A KV cache with room reserved for the tokens still to come, for the CPU decode loop.

transformers' ``DynamicLayer`` grows by ``torch.cat`` at every decode step: each of a model's layers copies its
whole key and value cache into a fresh tensor for one new position, so a completion of ``T`` tokens copies
``O(T²)``. On a 2-core AMD EPYC (SmolLM2-135M, float32, 8 rows = 2 prompts × 4, sampling to a fixed length)
reserving saves a few percent at 512 new tokens and next to nothing at 48 (benchmarks/RESULTS.md, 'Measurements
behind design choices'). :func:`reserve` swaps each plain ``DynamicLayer`` of a prefilled cache for a
:class:`ReservedLayer`, whose keys and values are views into buffers with room for ``extra`` more positions: a step
writes its position in place. The attention reads the same numbers (a view of the same values), so sampling is
unchanged; layers of any other kind (sliding windows, linear attention) are left as they are.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` are the first ``n`` positions of buffers holding more. Past
    the reserved room it grows the buffers (doubling), as a dynamic layer would."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        self.device = keys.device
        self._keys = self._buffer(keys, capacity)
        self._values = self._buffer(values, capacity)
        self._length = keys.shape[-2]
        self._publish()
        self.is_initialized = True

    @staticmethod
    def _buffer(states: torch.Tensor, capacity: int) -> torch.Tensor:
        b, h, n, d = states.shape
        buf = states.new_empty(b, h, max(capacity, n), d)
        buf[:, :, :n] = states
        return buf

    def _publish(self) -> None:
        self.keys = self._keys[:, :, :self._length]
        self.values = self._values[:, :, :self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self._length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            room = max(end, 2 * self._keys.shape[-2])
            self._keys, self._values = self._buffer(self.keys, room), self._buffer(self.values, room)
        self._keys[:, :, self._length:end] = key_states
        self._values[:, :, self._length:end] = value_states
        self._length = end
        self._publish()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        self._length = max(0, self._length + tokens_to_remove)
        self._publish()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._keys = self._keys.repeat_interleave(repeats, dim=0)
        self._values = self._values.repeat_interleave(repeats, dim=0)
        self._publish()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._publish()

    def reset(self) -> None:
        self._length = 0
        self._publish()


def reserve(cache, extra: int) -> int:
    """Give every plain ``DynamicLayer`` of ``cache`` (prefilled) room for ``extra`` more positions; returns how many
    layers it swapped (0 when the cache has none, e.g. a legacy tuple cache)."""
    layers = getattr(cache, "layers", None)
    if layers is None or extra <= 0:
        return 0
    swapped = 0
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
            layers[i] = ReservedLayer(layer.keys, layer.values, layer.keys.shape[-2] + extra)
            swapped += 1
    return swapped
