"""Every file grpokit writes goes through here: written beside its final place, flushed to disk, then renamed
into place in one step, so a crash or a full disk never leaves a half-written file (or checkpoint directory)
under a name a later run would read."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


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
