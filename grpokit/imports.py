"""Objects named in a config: ``package.module:name`` or ``path/to/file.py:name`` (a dotted ``name`` reaches into the
module, ``module:Class.method``). The one place configs import user code; importing runs that module's code, as any
import does."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .validation import refusal

_config_dirs: list[Path] = []


@contextmanager
def beside_config(directory: str | Path | None) -> Iterator[None]:
    """While active, module names and relative ``.py`` paths that are not found from the current directory are
    looked up in ``directory`` too (the config file's folder: ``grpokit train configs/job.yaml`` finds
    ``configs/my_rewards.py`` from anywhere)."""
    if directory is None:
        yield
        return
    _config_dirs.append(Path(directory).resolve())
    try:
        yield
    finally:
        _config_dirs.pop()


def _where() -> str:
    places = [str(Path.cwd())] + [str(d) for d in _config_dirs if d != Path.cwd()]
    return " and ".join(dict.fromkeys(places))


def import_object(spec: str, field: str) -> Any:
    """The object ``spec`` names; a bad spec is a ``ValueError`` naming ``field``, the spec and what went wrong.
    Module names are looked up from the current directory too (as ``python -m`` does); a ``.py`` path is relative
    to it."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(p.strip() for p in spec.split(":")):
        raise refusal(field, spec, "expected 'package.module:name' or 'path/to/file.py:name'")
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
    for d in [Path.cwd(), *_config_dirs]:
        if str(d) not in sys.path:
            sys.path.append(str(d))
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name != e.name and not name.startswith(f"{e.name}."):
            # the module was found but imports something missing: that is its own error, not a lookup problem
            raise ValueError(f"{field}={spec!r}: importing {name!r} failed: {e}") from None
        raise ValueError(f"{field}={spec!r}: cannot import module {name!r} (no {name.replace('.', '/')}.py or package "
                         f"in {_where()}, nor installed); or name a file: path/to/file.py:name") from None
    except ImportError as e:
        raise ValueError(f"{field}={spec!r}: cannot import module {name!r} ({e})") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while running: one line naming it
        raise ValueError(f"{field}={spec!r}: importing {name!r} failed: {type(e).__name__}: {e}") from e


def _load_file(path: str, field: str, spec: str):
    file = Path(path).expanduser()
    if not file.is_absolute() and not file.is_file():
        file = next((d / file for d in _config_dirs if (d / file).is_file()), file)
    file = file.resolve()
    if not file.is_file():
        raise ValueError(f"{field}={spec!r}: no file {path!r} (relative paths are looked up in {_where()})")
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
