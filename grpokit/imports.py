"""Objects named in a config: ``package.module:name`` or ``path/to/file.py:name`` (a dotted ``name`` reaches into the
module, ``module:Class.method``). The one place configs import user code; importing runs that module's code, as any
import does."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def import_object(spec: str, field: str) -> Any:
    """The object ``spec`` names; a bad spec is a ``ValueError`` naming ``field``, the spec and what went wrong.
    Module names are looked up from the current directory too (as ``python -m`` does); a ``.py`` path is relative
    to it."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(p.strip() for p in spec.split(":")):
        raise ValueError(f"{field}={spec!r} is not allowed: expected 'package.module:name' or 'path/to/file.py:name'")
    module_name, attr = (p.strip() for p in spec.split(":"))
    module = _load_file(module_name, field, spec) if module_name.endswith(".py") else _load_module(module_name, field,
                                                                                                     spec)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}={spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _load_module(name: str, field: str, spec: str):
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ValueError(f"{field}={spec!r}: cannot import module {name!r} ({e})") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while running: one line naming it
        raise ValueError(f"{field}={spec!r}: importing {name!r} failed: {type(e).__name__}: {e}") from e


def _load_file(path: str, field: str, spec: str):
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"{field}={spec!r}: no file {path!r} (relative paths start at {Path.cwd()})")
    key = f"grpokit_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if key in sys.modules:
        return sys.modules[key]
    loader_spec = importlib.util.spec_from_file_location(key, file)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[key] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file failed while running: one line naming it
        del sys.modules[key]
        raise ValueError(f"{field}={spec!r}: running {path!r} failed: {type(e).__name__}: {e}") from e
    return module
