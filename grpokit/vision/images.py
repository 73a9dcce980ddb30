"""A dataset row's images as PIL images: the ``images`` column (a list per row) or the ``image`` column (one per row),
as TRL 1.16 reads them.

A value is a PIL image, a file path (relative paths are read from ``base_dir``, the data file's folder), raw bytes,
a dict with ``bytes`` and/or ``path`` (how 🤗 datasets stores an ``Image`` feature), or a numpy array (H, W[, C]).
A missing or unreadable image is one ``ValueError`` naming the row and the file.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..validation import short_repr

IMAGE_COLUMNS = ("images", "image")
"""The columns that carry a row's images, in the order they are looked for (TRL 1.16's)."""

REMOTE_PREFIXES = ("http://", "https://", "s3://", "gs://", "hf://")


def image_column(columns: Sequence[str] | None) -> str | None:
    """The column that carries the images (``images`` before ``image``), or None."""
    for name in IMAGE_COLUMNS:
        if columns is not None and name in columns:
            return name
    return None


def _where(row: int | None, column: str) -> str:
    return f"row {row}: {column}" if row is not None else column


def _open(source: Any, described: str):
    """``PIL.Image.open`` with the pixels read now (a broken file fails here, not inside a processor)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(source)
        image.load()
    except FileNotFoundError:
        raise ValueError(f"{described} does not exist") from None
    except UnidentifiedImageError:
        raise ValueError(f"{described} is not an image file PIL can read") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or damaged files
        raise ValueError(f"{described} could not be read ({type(e).__name__}: {e})") from None
    return image


def _from_path(value: str | os.PathLike, where: str, base_dir: str | os.PathLike | None):
    text = os.fspath(value)
    if text.startswith(REMOTE_PREFIXES):
        raise ValueError(f"{where} names a remote image {short_repr(text)}; grpokit reads local files only: download "
                         f"it and name the file")
    path = Path(text).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if path.is_dir():
        raise ValueError(f"{where}: image file {str(path)!r} is a directory")
    return _open(path, f"{where}: image file {str(path)!r}")


def to_pil(value: Any, *, row: int | None = None, column: str = "image", base_dir: str | os.PathLike | None = None):
    """One image value (see the module docstring) as a PIL image; a ``ValueError`` naming the row, the column and
    the file when it cannot be read."""
    from PIL import Image

    where = _where(row, column)
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (str, os.PathLike)):
        return _from_path(value, where, base_dir)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open(io.BytesIO(bytes(value)), f"{where}: the image bytes")
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            name = value.get("path")
            return _open(io.BytesIO(bytes(value["bytes"])), f"{where}: the image bytes" + (f" of {name!r}" if name else ""))
        if value.get("path") is not None:
            return _from_path(value["path"], where, base_dir)
        raise ValueError(f"{where} is an image record with neither bytes nor a path")
    if hasattr(value, "__array__") and hasattr(value, "shape"):
        import numpy as np

        array = np.asarray(value)
        if array.ndim not in (2, 3) or array.size == 0:
            raise ValueError(f"{where} is an array of shape {tuple(array.shape)}; an image is (height, width) or "
                             f"(height, width, channels)")
        if array.dtype != np.uint8:
            array = np.clip(array, 0, 255).astype(np.uint8)
        return Image.fromarray(array)
    raise ValueError(f"{where} is {short_repr(value)} ({type(value).__name__}); an image is a PIL image, a file path, "
                     f"bytes, a {{'bytes': ..., 'path': ...}} record or an array")


def row_images(row: Mapping, *, row_index: int | None = None,
               base_dir: str | os.PathLike | None = None) -> list | None:
    """The PIL images of one dataset row, in order: its ``images`` list, else its ``image`` (None or missing: no
    image). None when the row has neither column (a text-only row)."""
    column = image_column(list(row))
    if column is None:
        return None
    value = row[column]
    if value is None:
        return []
    if column == "images":
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            value = [value]  # one image where a list was expected
        return [to_pil(v, row=row_index, column=f"images[{i}]", base_dir=base_dir)
                for i, v in enumerate(value) if v is not None]
    return [to_pil(value, row=row_index, column="image", base_dir=base_dir)]


def batch_images(rows: Sequence[Mapping], *, base_dir: str | os.PathLike | None = None,
                 first_row: int = 0) -> list[list] | None:
    """Every row's images (a list per row, empty for a row without one), or None when no row has an image column or
    no row has an image (as TRL, a batch without any image is a text batch)."""
    per_row = [row_images(r, row_index=first_row + i, base_dir=base_dir) for i, r in enumerate(rows)]
    if all(not images for images in per_row):
        return None
    return [images or [] for images in per_row]


def check_images(dataset, *, name: str = "train_dataset", base_dir: str | os.PathLike | None = None,
                 limit: int | None = None) -> int:
    """Read every image of ``dataset`` (its first ``limit`` rows when given) once, before training: the first that is
    missing or unreadable is one ``ValueError`` naming the dataset, the row and the file (a 🤗 ``Image`` column that
    fails to decode included). Returns how many images were read. A dataset read as a stream is not checked."""
    columns = getattr(dataset, "column_names", None)
    if (columns is not None and image_column(columns) is None) or not hasattr(dataset, "__len__"):
        return 0
    count = 0
    for i in range(len(dataset) if limit is None else min(limit, len(dataset))):
        try:
            row = dataset[i]
            images = row_images(row, row_index=i, base_dir=base_dir)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        except Exception as e:  # datasets decoding an Image feature: FileNotFoundError, PIL errors, ...
            raise ValueError(f"{name}: row {i}: its image could not be read ({type(e).__name__}: {e})") from None
        count += len(images or [])
    return count
