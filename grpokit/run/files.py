"""Every file grpokit writes goes through here: written beside its final place, flushed to disk, then renamed
into place in one step, so a crash or a full disk never leaves a half-written file (or checkpoint directory)
under a name a later run would read."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

DISK_FULL_TEXTS = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
"""How a full disk reads in errors that carry no errno: safetensors' ``SafetensorError("... I/O error: No space left
on device (os error 28)")`` (Rust's text), and the same for a quota."""

LOW_SPACE_BYTES = 1 << 20
"""``torch.save`` on a full disk raises a ``RuntimeError`` that says nothing of it (``unexpected pos 576 vs 534``):
a failed write whose file system has less than this free is taken for a full disk."""


def is_disk_full(error: BaseException, path: str | os.PathLike | None = None) -> bool:
    """Whether ``error`` (or an exception it was raised from) comes from a full disk or quota: an ``OSError`` with
    ``ENOSPC``/``EDQUOT``, an error whose text says so (safetensors), or, given the ``path`` being written, any
    write error while that file system has under :data:`LOW_SPACE_BYTES` free (torch's zip writer)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(error).lower() for t in DISK_FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    if path is None:
        return False
    try:
        return shutil.disk_usage(path).free < LOW_SPACE_BYTES
    except OSError:
        return False


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a directory's entry to disk (best effort: some file systems refuse directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """Flush every file below ``path``, then ``path`` itself."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(root, name))
    fsync_path(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (a temporary file in the same directory, fsync, ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_path(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def publish_directory(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the finished directory ``tmp`` to ``final`` in one step; an existing ``final`` (the same step saved
    again) is moved aside first and deleted after."""
    tmp, final = str(tmp), str(final)
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(os.path.dirname(final) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
