"""The names of every ``GRPOConfig`` field, for checking a job spec's keys before the slow import of transformers.

The names are read from ``GRPOConfig`` itself (its own fields, transformers' ``TrainingArguments`` and every loss's
hyper-parameters) and cached on first use, per transformers version and per grpokit source (a hash of the package's
files), in ``$GRPOKIT_CACHE`` or ``~/.cache/grpokit`` (``XDG_CACHE_HOME`` honoured). The first job on a machine, or
after an upgrade, pays the import of transformers before its keys are checked (a few seconds, which the job then
needs anyway); later ones check them in milliseconds. Nothing is generated into the source tree. A cache that cannot
be read or written is ignored: the names are then read from ``GRPOConfig`` every time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def cache_dir() -> Path:
    if os.environ.get("GRPOKIT_CACHE"):
        return Path(os.environ["GRPOKIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpokit"


def source_key() -> str:
    """What the field names depend on: the installed transformers and grpokit's own source, hashed."""
    digest = hashlib.blake2b(digest_size=10)
    try:
        digest.update(importlib.metadata.version("transformers").encode())
    except importlib.metadata.PackageNotFoundError:
        digest.update(b"no-transformers")
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE_DIR)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def names_from_config() -> frozenset[str]:
    import dataclasses

    from .config import GRPOConfig

    return frozenset(f.name for f in dataclasses.fields(GRPOConfig) if f.init)


def config_field_names() -> frozenset[str]:
    """Every field a config may set: from the cache when it matches this installation, else from ``GRPOConfig``
    (then cached)."""
    path = cache_dir() / f"config-fields-{source_key()}.json"
    try:
        return frozenset(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    names = names_from_config()
    try:
        from .run.files import atomic_write_text

        atomic_write_text(path, json.dumps(sorted(names)))
    except OSError:
        pass
    return names
