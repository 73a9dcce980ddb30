"""Reading a file's framing without loading it: a safetensors header and its promised size, a JSON file, a
``torch.save`` zip archive with its CRC-32s. Used before a resume (checkpoints) and before a model loads (weights);
a damaged file is a :class:`grpokit.run.run_dir.CheckpointError` naming it and what is wrong."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

from .run_dir import CheckpointError

CHECKPOINT_HINT = "resume from an earlier checkpoint or delete this one"


def damaged(f: Path, what: str, hint: str = CHECKPOINT_HINT) -> CheckpointError:
    return CheckpointError(f"{f} is damaged: {what}; {hint}")


def check_safetensors(f: Path, hint: str = CHECKPOINT_HINT) -> None:
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise damaged(f, f"the file has {size} bytes, too short for a safetensors header", hint)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise damaged(f, f"the header claims {n} bytes but the file has {size} (truncated)", hint)
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise damaged(f, f"the safetensors header is not valid JSON ({e})", hint) from None
    if not isinstance(header, dict):
        raise damaged(f, "the safetensors header is not a JSON object", hint)
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end != size:
        raise damaged(f, f"the header promises {8 + n + end} bytes but the file has {size}"
                          + (" (truncated)" if size < 8 + n + end else ""), hint)


def check_json(f: Path) -> None:
    try:
        json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(f, f"not valid JSON ({e})") from None


def check_torch_save(f: Path) -> None:
    """A ``torch.save`` file is a zip archive: its directory must be there and every entry must match its CRC-32
    (``torch.load`` itself does not check them, so a flipped byte would load silently)."""
    try:
        with zipfile.ZipFile(f) as z:
            size = f.stat().st_size
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    raise damaged(f, f"entry {info.filename!r} runs past the end of the file (truncated)")
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise damaged(f, f"not a readable torch.save archive ({e}; truncated?)") from None
    if bad is not None:
        raise damaged(f, f"entry {bad!r} does not match its CRC-32 checksum")
