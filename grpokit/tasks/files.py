"""Tasks from local files: JSONL / JSON / CSV / Parquet with a prompt and an answer per row."""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path
from typing import Any

from datasets import Dataset

from ..rewards import correctness, extract_gsm8k_answer, format_reward
from .base import ANSWER_INSTRUCTION, Task

__all__ = ["SUPPORTED_SUFFIXES", "is_dataset_file", "load_dataset_file", "make_file_task"]

#: File suffix -> ``datasets`` builder. Compressed variants (``.jsonl.gz``, ...) work too.
SUPPORTED_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_COMPRESSION = {".gz", ".bz2", ".xz", ".zst", ".zip"}


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION:
        suffixes.pop()
    return SUPPORTED_SUFFIXES.get(suffixes[-1]) if suffixes else None


def is_dataset_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a file :func:`load_dataset_file` can read (by its suffix)."""
    return _builder_for(Path(path)) is not None


def _to_messages(value: Any, row: int, path: Path, column: str, system_prompt: str | None) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{path}: row {row} has an empty {column!r}.")
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        messages = [{"role": str(m["role"]), "content": m.get("content") or ""} for m in value]
    else:
        raise ValueError(
            f"{path}: row {row} has a {column!r} that is neither text nor a list of chat messages "
            f"({{'role': ..., 'content': ...}}): {value!r:.120}"
        )
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _image_value(value: Any, row: int, path: Path, column: str) -> Any:
    """One image of a row: a file path made absolute (relative to the data file's folder) and checked to be an image
    file; a ``{"bytes", "path"}`` record (Parquet's image struct) kept, its relative path made absolute."""
    from PIL import Image, UnidentifiedImageError

    if value is None or isinstance(value, Image.Image):  # a decoded Parquet / datasets image: kept
        return value
    if isinstance(value, dict):
        if value.get("bytes") is None and value.get("path"):
            return {**value, "path": _image_value(value["path"], row, path, column)}
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{path}: row {row} has an {column!r} of {value!r:.80}; expected an image file path")
    if value.startswith(("http://", "https://")):
        raise ValueError(f"{path}: row {row}: {column} {value!r:.120} is a URL; grpokit reads local image files only")
    file = Path(value).expanduser()
    if not file.is_absolute():
        file = path.parent / file
    if not file.is_file():
        raise ValueError(f"{path}: row {row}: image file {value!r} not found (looked for {str(file.absolute())!r})")
    try:
        with Image.open(file):  # reads the header only
            pass
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{path}: row {row}: image file {value!r} is not an image PIL can read ({type(e).__name__})") \
            from None
    return str(file.resolve())


def _image_column(values: list, path: Path, column: str) -> list:
    """An ``image`` column (one path per row) or an ``images`` column (a list per row; in a CSV file a JSON list
    such as ``["a.png", "b.png"]`` or one path) with every path checked and made absolute."""
    out = []
    for row, value in enumerate(values):
        if column == "images":
            if isinstance(value, str) and value.lstrip().startswith("["):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: row {row}: images {value!r:.80} is not a JSON list ({e.msg})") from None
            items = value if isinstance(value, list) else ([] if value is None else [value])
            out.append([_image_value(v, row, path, column) for v in items])
        else:
            out.append(_image_value(value, row, path, column))
    return out


def _append_instruction(messages: list[dict], instruction: str) -> list[dict]:
    for message in reversed(messages):
        if message["role"] == "user":
            content = message["content"]
            if isinstance(content, str) and instruction not in content:
                message["content"] = f"{content.rstrip()} {instruction}"
            break
    return messages


@contextlib.contextmanager
def _no_progress_bars():
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            ds_logging.enable_progress_bar()


def _check_utf8(path: Path) -> None:
    """A text file that is not UTF-8 is one error naming the line (datasets would read it and fail later)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                line += chunk[:e.start].count(b"\n")
                raise ValueError(f"{path}: line {line} is not UTF-8 text (byte {offset + e.start}: {e.reason}); save "
                                 "the file as UTF-8") from None
            line += chunk.count(b"\n")
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: the file ends inside a UTF-8 character ({e.reason})") from None


def _bad_jsonl_line(path: Path) -> str | None:
    """The first line of a JSONL file that is not one JSON object, as "line N: what is wrong"; None if every line
    is fine (the problem is elsewhere)."""
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    return f"line {number} is not valid JSON ({e.msg}, column {e.colno})"
                if not isinstance(value, dict):
                    return f"line {number} is not a JSON object (got {type(value).__name__}); write one object per line"
    except UnicodeDecodeError as e:
        return f"the file is not UTF-8 text (byte {e.start}: {e.reason})"
    return None


def load_dataset_file(
    path: str | os.PathLike,
    *,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    system_prompt: str | None = None,
    instruction: str | None = None,
) -> Dataset:
    """Read a local JSONL / JSON / CSV / Parquet file into a ``prompt`` + ``answer`` dataset.

    Args:
        path: the file (suffix ``.jsonl``, ``.json``, ``.csv`` or ``.parquet``, optionally compressed).
        prompt_column: column holding the prompt: plain text (becomes one user turn) or a list of chat
            messages (kept).
        answer_column: column holding the gold answer, renamed ``answer`` and stored as text. GSM8K-style
            answers (``"...\\n#### 1,234"``) keep only the final number (``"1234"``). ``None``: no answer
            column (for rewards that need none).
        system_prompt: if given, a system turn put first in every prompt that has none.
        instruction: if given, appended to the last user turn of every prompt that does not already
            contain it (e.g. :data:`~grpokit.tasks.base.ANSWER_INSTRUCTION`).

    Other columns are kept: TRL passes them to the reward functions as keyword lists. An ``image`` column (a file
    path per row) or ``images`` column (a list of paths per row; in a CSV file a JSON list) names image files for a
    vision-language model, relative to the data file's folder: each is checked to exist and to be an image file,
    and stored as an absolute path (Parquet image records with bytes are kept as they are).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unsupported suffix, an empty file, a missing column (the message names the
            file, the column and the columns that exist), or a missing or unreadable image file (the message
            names the row and the file).
    """
    from datasets import load_dataset

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"Dataset file not found: {str(path)!r}.")
    builder = _builder_for(path)
    if builder is None:
        raise ValueError(
            f"{path}: unsupported file type; use one of {', '.join(SUPPORTED_SUFFIXES)} (optionally compressed)."
        )
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty.")
    if path.suffix in (".jsonl", ".json", ".csv"):
        _check_utf8(path)
    try:
        with _no_progress_bars():  # a local file reads in a moment: no "Generating train split" bars
            dataset = load_dataset(builder, data_files=str(path), split="train")
    except Exception as error:  # datasets raises many kinds, several unhelpful for an empty file
        where = _bad_jsonl_line(path) if path.suffix == ".jsonl" else None
        if where is not None:
            raise ValueError(f"{path}: {where}") from None
        raise ValueError(f"{path}: could not be read as {builder} ({type(error).__name__}: {error}).") from error
    if len(dataset) == 0:
        raise ValueError(f"{path}: the file has no rows.")

    columns = list(dataset.column_names)
    for role, column in (("prompt", prompt_column), ("answer", answer_column)):
        if column is not None and column not in columns:
            raise ValueError(
                f"{path}: no {role} column {column!r}; the columns are {', '.join(map(repr, columns))}. "
                f"Pass {role}_column= to name the right one."
            )

    data = dataset.to_dict()
    prompts = [
        _to_messages(value, i, path, prompt_column, system_prompt) for i, value in enumerate(data[prompt_column])
    ]
    if instruction:
        prompts = [_append_instruction(p, instruction) for p in prompts]
    out: dict[str, list] = {"prompt": prompts}
    if answer_column is not None:
        out["answer"] = [extract_gsm8k_answer(a) for a in data[answer_column]]
    for column in columns:
        if column not in (prompt_column, answer_column, "prompt", "answer"):
            out[column] = _image_column(data[column], path, column) if column in ("image", "images") else data[column]
    return Dataset.from_dict(out)


def _image_key(value: Any) -> Any:
    """An image as something ``json.dumps`` takes: its path, or a digest of its bytes or pixels."""
    import hashlib

    if isinstance(value, list):
        return [_image_key(v) for v in value]
    if isinstance(value, dict):
        data = value.get("bytes")
        return hashlib.sha256(data).hexdigest() if data is not None else value.get("path")
    if hasattr(value, "tobytes") and hasattr(value, "size"):  # a PIL image
        return hashlib.sha256(value.tobytes()).hexdigest()
    return value


def _row_keys(dataset: Dataset) -> list[str]:
    """Per row, its prompt and its images (rows asking the same question about different pictures differ)."""
    columns = [c for c in ("image", "images") if c in dataset.column_names]
    images = [dataset[c] for c in columns]
    return [json.dumps([prompt, *(_image_key(col[i]) for col in images)], sort_keys=True, ensure_ascii=False)
            for i, prompt in enumerate(dataset["prompt"])]


def make_file_task(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    n_eval: int = 128,
    eval_file: str | os.PathLike | None = None,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    system_prompt: str | None = None,
    instruction: str | None = ANSWER_INSTRUCTION,
) -> Task:
    """A task over a local file graded by ``correctness`` + ``format``.

    Rows are shuffled by ``seed``; the first ``n_eval`` are held out, unless ``eval_file`` is given, in
    which case the held-out rows are the first ``n_eval`` of that file (shuffled) and the whole of
    ``path`` trains. Training rows whose prompt (and images) also appear among the held-out ones are dropped.
    By default every prompt is asked to end with ``Answer: <number>`` (``instruction``), since the
    rewards read that line; pass ``instruction=None`` if the prompts already ask for it differently.
    """
    if not isinstance(n_eval, int) or isinstance(n_eval, bool) or n_eval < 0:
        raise ValueError(f"Task 'file:{path}': n_eval must be a non-negative integer, got {n_eval!r}.")
    options = dict(
        prompt_column=prompt_column, answer_column=answer_column, system_prompt=system_prompt, instruction=instruction
    )
    dataset = load_dataset_file(path, **options)
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    if eval_file is None:
        if n_eval >= len(dataset):
            raise ValueError(
                f"{path}: n_eval={n_eval} leaves nothing to train on; the file has {len(dataset)} rows."
            )
        held_out = dataset.select(order[:n_eval])
        train = dataset.select(order[n_eval:])
    else:
        train = dataset.select(order)
        eval_dataset = load_dataset_file(eval_file, **options)
        eval_order = list(range(len(eval_dataset)))
        random.Random(seed).shuffle(eval_order)
        held_out = eval_dataset.select(eval_order[: min(n_eval, len(eval_dataset))])
    held_keys = set(_row_keys(held_out))
    keep = [i for i, key in enumerate(_row_keys(train)) if key not in held_keys]
    dropped = len(train) - len(keep)
    if dropped:
        train = train.select(keep)
    if len(train) == 0:
        raise ValueError(f"{path}: every training prompt also appears in the held-out set.")
    description = (
        f"Prompts from {path} ({len(train)} train, {len(held_out)} held out"
        + (f" from {eval_file}" if eval_file is not None else "")
        + (f"; {dropped} training rows dropped as duplicates of held-out prompts" if dropped else "")
        + "). Rewards: correctness 1.0 when the number after the last 'Answer:' equals the answer "
        "(math-verify for non-plain answers), format 0.2 for ending with 'Answer: <number>'."
    )
    return Task(
        name=f"file:{path}",
        train_dataset=train,
        eval_dataset=held_out,
        reward_funcs=[correctness, format_reward],
        accuracy_reward="correctness",
        description=description,
        metadata={"seed": seed, "n_eval": n_eval, "path": str(path), "dropped_duplicates": dropped},
    )
