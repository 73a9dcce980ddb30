"""Rich table of sample completions (for ``log_completions=True``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._util import as_text, to_float, truncate


def _seq(x: Any) -> list:
    if x is None:
        return []
    tolist = getattr(x, "tolist", None)
    if callable(tolist):
        x = tolist()
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _cell(v: Any) -> str:
    f = to_float(v)
    if f is None:
        return "—" if v is None else str(v)
    return "nan" if not math.isfinite(f) else f"{f:.2f}"


def log_completions_table(prompts: Sequence[Any], completions: Sequence[Any], rewards: dict[str, Sequence[float]],
                          advantages: Sequence[float] | Any, step: int, max_rows: int = 8, *, console=None,
                          max_prompt_chars: int = 200, max_completion_chars: int = 400,
                          extra: dict[str, Sequence[Any]] | None = None):
    """Print a rich table (prompt, completion, one column per reward function, one per ``extra`` column — what
    reward functions logged with ``log_extra`` —, advantage) of the first ``max_rows`` samples at ``step``; returns
    the ``rich.table.Table``. Text is never parsed as rich markup. Prompts/completions may be strings or
    chat-message lists; rewards/advantages lists or tensors."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    prompts, completions = _seq(prompts), _seq(completions)
    reward_cols = {str(name): _seq(vals) for name, vals in (rewards or {}).items()}
    extra_cols = {str(name): _seq(vals) for name, vals in (extra or {}).items()}
    adv = _seq(advantages)
    n = min(len(prompts), len(completions)) if prompts else len(completions)
    shown = min(n, max_rows) if max_rows is not None else n

    table = Table(title=f"Completions @ step {step}" + (f" (first {shown} of {n})" if shown < n else ""),
                  show_lines=True, expand=True, title_justify="left")
    table.add_column("prompt", ratio=2, overflow="fold")
    table.add_column("completion", ratio=4, overflow="fold")
    for name in reward_cols:
        table.add_column(name, justify="right", no_wrap=True)
    for name in extra_cols:
        table.add_column(name, overflow="fold")
    if adv:
        table.add_column("advantage", justify="right", no_wrap=True)
    for i in range(shown):
        row = [Text(truncate(as_text(prompts[i]) if i < len(prompts) else "", max_prompt_chars)),
               Text(truncate(as_text(completions[i]), max_completion_chars))]
        row += [_cell(vals[i] if i < len(vals) else None) for vals in reward_cols.values()]
        row += [Text(truncate(as_text(vals[i]), max_completion_chars)) if i < len(vals) and vals[i] is not None
                else Text("—") for vals in extra_cols.values()]
        if adv:
            row.append(_cell(adv[i] if i < len(adv) else None))
        table.add_row(*row)
    (console or Console()).print(table)
    return table


def completions_frame(step: int, prompts: Sequence[Any], completions: Sequence[Any], rewards: dict[str, Sequence[float]],
                      advantages: Sequence[float], extra: dict[str, Sequence[Any]] | None = None, *,
                      unique_prompts: bool = False):
    """The completions table as TRL logs it (a pandas DataFrame: step, prompt, completion, one column per reward
    function and per ``extra`` column, advantage); ``unique_prompts``: the first row of each prompt only."""
    import pandas as pd

    n = len(completions)
    table = {"step": [step] * n, "prompt": [as_text(p) for p in prompts], "completion": [as_text(c) for c in completions]}
    table.update({str(k): _seq(v) for k, v in (rewards or {}).items()})
    table.update({str(k): [as_text(x) if x is not None else None for x in _seq(v)] for k, v in (extra or {}).items()})
    table["advantage"] = _seq(advantages)
    frame = pd.DataFrame(table)
    return frame[~frame["prompt"].duplicated()] if unique_prompts else frame


def log_completions(samples: dict[str, Any], step: int, output_dir: str, *, max_rows: int, unique_prompts: bool,
                    report_to: Sequence[str], tensorboard=None) -> None:
    """A batch's completions (:attr:`grpokit.pipeline.RolloutStats.samples`) as TRL logs them: a table in the terminal,
    ``output_dir/completions/completions_<step>.parquet``, and a ``completions`` table to wandb when it is a reporting
    target (one row per prompt with ``unique_prompts``). Samples with ``images`` (a vision-language model's prompts,
    ``log_multimodal``) add an ``image`` column to the wandb table (TRL's), and to ``tensorboard`` (the run's
    ``SummaryWriter``, :func:`tensorboard_writer`) the pictures of the first ``max_rows`` rows' prompts with the table
    as text."""
    import io
    import os

    from ..run.files import atomic_write_bytes

    s = samples
    log_completions_table(s["prompt"], s["completion"], s["rewards"], s["advantage"], step, max_rows=max_rows,
                          extra=s["extra"])
    frame = completions_frame(step, s["prompt"], s["completion"], s["rewards"], s["advantage"], s["extra"],
                              unique_prompts=unique_prompts)
    buffer = io.BytesIO()
    frame.to_parquet(buffer)
    atomic_write_bytes(os.path.join(output_dir, "completions", f"completions_{step:05d}.parquet"), buffer.getvalue())
    images = s.get("images")
    if "wandb" in (report_to or []):
        import wandb

        if wandb.run is not None:
            table = with_images(frame, images, wandb.Image) if images else frame
            wandb.log({"completions": wandb.Table(dataframe=table)})
    if tensorboard is not None and images:
        tensorboard_images(frame.head(max_rows), images, step, tensorboard)


def tensorboard_writer(callbacks: Sequence[Any]):
    """The ``SummaryWriter`` of transformers' tensorboard callback among ``callbacks`` (None without one, or before
    it opened its writer)."""
    from transformers.integrations import TensorBoardCallback

    return next((getattr(c, "tb_writer", None) for c in callbacks if isinstance(c, TensorBoardCallback)), None)


def with_images(frame, images: Sequence[Sequence[Any]], image_cls):
    """``frame`` with an ``image`` column: each row's prompt images as ``image_cls`` values (``wandb.Image``), in
    the rows ``frame`` kept (its index: the samples' row numbers)."""
    column = [[image_cls(img) for img in (images[i] or [])] for i in frame.index]
    return frame.assign(image=column)


def tensorboard_images(frame, images: Sequence[Sequence[Any]], step: int, writer) -> int:
    """The prompt images of ``frame``'s rows into tensorboard's ``writer`` (``completions/image/<row>_<k>``), each
    distinct picture once, and the rows as text (``completions``). Returns how many images were written."""
    import numpy as np

    written, seen = 0, set()
    for i in frame.index:
        for k, image in enumerate(images[i] or []):
            if id(image) in seen:  # the rows of a group share their prompt's pictures
                continue
            seen.add(id(image))
            writer.add_image(f"completions/image/{i}_{k}", np.asarray(image.convert("RGB")), step,
                             dataformats="HWC")
            written += 1
    text = frame.drop(columns=["step"]).to_string(max_colwidth=200)
    writer.add_text("completions", "\n".join("    " + line for line in text.splitlines()), step)  # markdown code
    writer.flush()
    return written
