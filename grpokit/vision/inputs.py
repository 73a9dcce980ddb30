"""The image tensors a vision-language model takes beside its token ids, as one typed value that travels with its
prompts: :class:`VisionInputs`.

A processor returns tensors whose first dimension counts different things, by family:

- ``"row"``: one entry per prompt (Idefics3 / SmolVLM stack each prompt's images, padded, with a
  ``pixel_attention_mask``);
- ``"image"``: one entry per image, the images of all prompts in order (LLaVA's, Gemma 3's ``pixel_values``;
  ``image_grid_thw``, ``image_sizes``);
- ``"patch"``: one entry per image patch, the patches of all images in order (Qwen2-VL / Qwen2.5-VL / Qwen3-VL's
  flattened ``pixel_values``: image ``i`` has ``image_grid_thw[i].prod()`` rows);
- ``"token"``: one entry per prompt along the prompt's tokens (``token_type_ids``, ``mm_token_type_ids``), stored
  right-aligned like left-padded ids, so they are fitted to any prompt width and extended with zeros over a
  completion.

Selecting prompts, repeating them for the ``G`` rows of a group, concatenating batches and moving to a device all
respect those units.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")
"""Per-token tensors (zero on text, the modality elsewhere)."""
TEXT_KEYS = ("input_ids", "attention_mask")
"""What a processor returns that is not an image tensor."""
IMAGE_KEYS = ("image_grid_thw", "image_sizes", "image_position_ids", "spatial_shapes")
UNITS = ("row", "image", "patch", "token")


def pixel_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a model is given pixel values in: its weights' (the first floating-point one's)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _units_of(output: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's unit (see the module docstring) from its name and the family's layout."""
    units = {}
    stacked = "pixel_attention_mask" in output and getattr(output.get("pixel_values"), "dim", lambda: 0)() == 5
    for key, value in output.items():
        if key in TEXT_KEYS or not isinstance(value, torch.Tensor):
            continue
        if key in TOKEN_KEYS:
            units[key] = "token"
        elif key == "pixel_values" and "image_grid_thw" in output:
            units[key] = "patch"
        elif key in ("pixel_values", "pixel_attention_mask") and stacked:
            units[key] = "row"
        else:
            units[key] = "image"
    return units


def _pad_to(t: torch.Tensor, dim: int, size: int, left: bool = False) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    pad = t.new_zeros(shape)
    return torch.cat([pad, t] if left else [t, pad], dim)


@dataclass
class VisionInputs:
    """The image tensors of ``rows`` prompts (see the module docstring); ``images_per_row[i]`` images belong to
    prompt ``i`` and, for ``"patch"`` tensors, ``patches_per_image[j]`` patches to image ``j``."""

    tensors: dict[str, torch.Tensor]
    units: dict[str, str]
    images_per_row: list[int]
    patches_per_image: list[int] | None = None
    token_width: int = 0
    """The width of the ``"token"`` tensors (the longest prompt they were made for)."""
    _row_image_offsets: list[int] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self):
        bad = {k: u for k, u in self.units.items() if u not in UNITS}
        if bad or set(self.units) != set(self.tensors):
            raise ValueError(f"VisionInputs: units {self.units} do not describe tensors {sorted(self.tensors)}")
        self._row_image_offsets = [0, *itertools.accumulate(self.images_per_row)]

    # -- building ------------------------------------------------------------------------------------------------
    @classmethod
    def from_processor_output(cls, output: Mapping, images_per_row: Sequence[int]) -> VisionInputs:
        """The image tensors of a processor's output for ``len(images_per_row)`` prompts (its ``input_ids`` and
        ``attention_mask`` are left out)."""
        units = _units_of(output)
        tensors = {k: output[k] for k in units}
        n = len(images_per_row)
        patches = None
        if "patch" in units.values():
            patches = [int(p) for p in output["image_grid_thw"].prod(-1).tolist()]
        width = max((tensors[k].shape[1] for k, u in units.items() if u == "token"), default=0)
        inputs = cls(tensors, units, list(map(int, images_per_row)), patches, width)
        inputs._check(n)
        return inputs

    def _check(self, n: int) -> None:
        expected = {"row": n, "token": n, "image": sum(self.images_per_row),
                    "patch": sum(self.patches_per_image or [])}
        for key, unit in self.units.items():
            if self.tensors[key].shape[0] != expected[unit]:
                raise ValueError(f"VisionInputs: {key} has {self.tensors[key].shape[0]} entries where {expected[unit]} "
                                 f"{unit}s were expected (images per prompt {self.images_per_row}); this processor's "
                                 f"layout is not supported")

    @classmethod
    def cat(cls, parts: Sequence[VisionInputs | None], rows_per_part: Sequence[int] | None = None) -> VisionInputs | None:
        """The prompts of ``parts`` one after another. A None part (prompts without images, ``rows_per_part`` of
        them) contributes rows without images. None when no part has images."""
        if rows_per_part is None:
            rows_per_part = [p.rows if p is not None else 1 for p in parts]
        real = [p for p in parts if p is not None]
        if not real:
            return None
        units = {}
        for p in real:
            units.update(p.units)
        width = max(p.token_width for p in real)
        tensors, images, patches = {}, [], []
        for key, unit in units.items():
            pieces = []
            for p, n in zip(parts, rows_per_part):
                t = p.tensors.get(key) if p is not None else None
                if t is None:
                    t = cls._empty_like(key, unit, real, n)
                    if t is None:
                        continue
                pieces.append(t)
            if unit == "token":
                pieces = [_pad_to(t, 1, width, left=True) for t in pieces]
            for dim in range(1, pieces[0].dim()):  # stacked images (Idefics3), image tiles (LLaVA-NeXT): zeros
                most = max(t.shape[dim] for t in pieces)
                pieces = [_pad_to(t, dim, most) for t in pieces]
            tensors[key] = torch.cat(pieces, 0)
        for p, n in zip(parts, rows_per_part):
            images.extend(p.images_per_row if p is not None else [0] * n)
            if p is not None and p.patches_per_image:
                patches.extend(p.patches_per_image)
        merged = cls(tensors, units, images, patches if "patch" in units.values() else None, width)
        merged._check(len(images))
        return merged

    @staticmethod
    def _empty_like(key: str, unit: str, real: Sequence[VisionInputs], rows: int) -> torch.Tensor | None:
        """What ``rows`` prompts without this tensor contribute: nothing for image/patch tensors, zeros for the
        others (a stacked row tensor with no image, a token tensor of width 0)."""
        if unit in ("image", "patch"):
            return None
        like = next(p.tensors[key] for p in real if key in p.tensors)
        shape = [rows, 0, *like.shape[2:]] if unit == "token" or like.dim() > 1 else [rows]
        return like.new_zeros(shape)

    # -- rows ----------------------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.images_per_row)

    @property
    def num_images(self) -> int:
        return sum(self.images_per_row)

    def _image_index(self, rows: Sequence[int]) -> list[int]:
        off = self._row_image_offsets
        return [j for r in rows for j in range(off[r], off[r + 1])]

    def _patch_index(self, images: Sequence[int]) -> list[int]:
        off = [0, *itertools.accumulate(self.patches_per_image or [])]
        return [k for j in images for k in range(off[j], off[j + 1])]

    def select(self, rows: Sequence[int] | slice | range) -> VisionInputs:
        """The prompts ``rows`` (indices, a range or a slice), in that order (repeats allowed)."""
        if isinstance(rows, slice):
            rows = range(*rows.indices(self.rows))
        rows = [int(r) for r in rows]
        if any(r < 0 or r >= self.rows for r in rows):
            raise IndexError(f"VisionInputs: rows {rows} out of range for {self.rows} prompts")
        images = self._image_index(rows)
        index = {"row": rows, "token": rows, "image": images,
                 "patch": self._patch_index(images) if self.patches_per_image is not None else []}
        tensors = {}
        for key, unit in self.units.items():
            t = self.tensors[key]
            tensors[key] = t.index_select(0, torch.tensor(index[unit], dtype=torch.long, device=t.device))
        patches = [self.patches_per_image[j] for j in images] if self.patches_per_image is not None else None
        return VisionInputs(tensors, dict(self.units), [self.images_per_row[r] for r in rows], patches,
                            self.token_width)

    def repeat_interleave(self, g: int) -> VisionInputs:
        """Every prompt ``g`` times in a row (the ``G`` rows of a group)."""
        return self.select([r for r in range(self.rows) for _ in range(g)])

    def equal_to_previous(self) -> torch.Tensor:
        """(rows - 1,) bool: whether prompt ``i + 1`` has the same images (equal tensors) as prompt ``i``."""
        if self.rows < 2:
            return torch.zeros(0, dtype=torch.bool)
        same = torch.tensor([self.images_per_row[i + 1] == self.images_per_row[i] for i in range(self.rows - 1)],
                            dtype=torch.bool)
        for key, unit in self.units.items():
            t = self.tensors[key]
            if unit in ("row", "token"):
                same &= (t[1:] == t[:-1]).reshape(self.rows - 1, -1).all(1).cpu()
                continue
            rows = [self.select([i]).tensors[key] for i in range(self.rows)]
            same &= torch.tensor([torch.equal(rows[i + 1], rows[i]) for i in range(self.rows - 1)], dtype=torch.bool)
        return same

    def is_grouped(self, g: int) -> bool:
        """Whether the prompts come as groups of ``g`` consecutive rows with equal image tensors (the rows of a group
        may then share one encoding of their prompt)."""
        if g < 1 or self.rows % g:
            return False
        same = self.equal_to_previous()
        return all(bool(same[i - 1]) for i in range(1, self.rows) if i % g)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> VisionInputs:
        """On ``device``; floating-point tensors (pixel values) in ``dtype`` when given (the model's)."""
        tensors = {k: t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None)
                   for k, t in self.tensors.items()}
        return VisionInputs(tensors, dict(self.units), list(self.images_per_row),
                            None if self.patches_per_image is None else list(self.patches_per_image), self.token_width)

    def extend_tokens(self, extra: Sequence[int]) -> VisionInputs:
        """The same prompts continued by ``extra[i]`` more tokens each (a multi-turn rollout's next prompt: the prompt,
        the completion so far and a tool turn): the ``"token"`` tensors get that many zeros after each row's prompt
        (text), and stay right-aligned."""
        if len(extra) != self.rows:
            raise ValueError(f"VisionInputs: {len(extra)} extensions for {self.rows} prompts")
        most = max(extra, default=0)
        tensors = dict(self.tensors)
        for key, unit in self.units.items():
            if unit == "token":
                t = self.tensors[key]
                tensors[key] = torch.stack([torch.cat([t.new_zeros(most - k), row, t.new_zeros(k)])
                                            for row, k in zip(t, extra)]) if self.rows else t
        return VisionInputs(tensors, dict(self.units), list(self.images_per_row),
                            None if self.patches_per_image is None else list(self.patches_per_image),
                            self.token_width + most)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def layout(self) -> dict:
        """What :meth:`from_layout` needs besides the tensors (JSON values): units and counts."""
        return {"units": dict(self.units), "images_per_row": list(self.images_per_row),
                "patches_per_image": None if self.patches_per_image is None else list(self.patches_per_image),
                "token_width": self.token_width}

    @classmethod
    def from_layout(cls, tensors: Mapping[str, torch.Tensor], layout: Mapping) -> VisionInputs:
        """The inverse of :meth:`layout` with the tensors; a layout that does not describe them is a ``ValueError``."""
        patches = layout.get("patches_per_image")
        inputs = cls(dict(tensors), {str(k): str(v) for k, v in layout["units"].items()},
                     [int(n) for n in layout["images_per_row"]], None if patches is None else [int(n) for n in patches],
                     int(layout.get("token_width", 0)))
        inputs._check(inputs.rows)
        return inputs

    # -- forwards ------------------------------------------------------------------------------------------------
    def fit_tokens(self, prompt_width: int, completion_width: int = 0) -> dict[str, torch.Tensor]:
        """The ``"token"`` tensors for prompts left-padded to ``prompt_width`` (padded with zeros or cut on the
        left), then ``completion_width`` zeros for a completion after them."""
        out = {}
        for key, unit in self.units.items():
            if unit != "token":
                continue
            t = self.tensors[key]
            t = t[:, t.shape[1] - prompt_width:] if t.shape[1] > prompt_width else _pad_to(t, 1, prompt_width, left=True)
            if completion_width:
                t = torch.cat([t, t.new_zeros((t.shape[0], completion_width))], 1)
            out[key] = t
        return out

    def model_kwargs(self, prompt_width: int, completion_width: int = 0) -> dict[str, torch.Tensor]:
        """Keyword arguments for a forward (or ``generate``) over prompts of ``prompt_width`` tokens followed by
        ``completion_width`` completion tokens. Nothing when these prompts have no image (a text forward)."""
        if self.num_images == 0:
            return {}
        kwargs = {k: t for k, t in self.tensors.items() if self.units[k] != "token"}
        kwargs.update(self.fit_tokens(prompt_width, completion_width))
        return kwargs
