"""``metrics.jsonl``: one JSON line per log event, appended and closed each time (a crash loses nothing)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..reporting._util import METRICS_FILENAME, finite_or_none, read_metrics, to_float


class MetricsJsonlCallback(TrainerCallback):
    """Append one JSON line per ``on_log`` event to ``<output_dir>/metrics.jsonl``.

    Each line holds ``step`` (``state.global_step``), ``epoch``, ``time`` (training wall-clock seconds
    since ``on_train_begin``; on a resume it continues from the time recorded at the resumed step) and
    every numeric value of the logs dict (numpy/torch scalars included; NaN/inf are written as
    ``null``; strings and other non-numbers are skipped). Only the world-process-zero writes. The file
    is opened in append mode and closed after every line, so a crash loses nothing and a resumed run
    appends instead of truncating. When the file already holds steps beyond the step this run starts
    at, the first new line carries ``"resumed_from": <start step>`` so that
    :func:`grpokit.reporting.read_metrics` drops the abandoned records.

    ``output_dir=None`` uses ``args.output_dir``.
    """

    def __init__(self, output_dir: str | os.PathLike | None = None, filename: str = METRICS_FILENAME):
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.filename = filename
        self._t0: float | None = None
        self._time_offset = 0.0
        self._resumed_from: int | None = None

    @property
    def path(self) -> Path | None:
        return None if self.output_dir is None else self.output_dir / self.filename

    def _resolve_dir(self, args) -> None:
        if self.output_dir is None and getattr(args, "output_dir", None):
            self.output_dir = Path(args.output_dir)

    def on_train_begin(self, args, state, control, **kwargs):
        self._resolve_dir(args)
        self._t0 = time.perf_counter()
        self._time_offset = 0.0
        if state.is_world_process_zero and state.global_step > 0 and self.path is not None:
            # resumed: continue the clock from the last record at or before the resumed step
            times = [r["time"] for r in read_metrics(self.path)
                     if r["step"] <= state.global_step and isinstance(r.get("time"), (int, float))]
            if times:
                self._time_offset = float(times[-1])
        self._resumed_from = None
        if state.is_world_process_zero and self.path is not None and self.path.exists():
            if any(r["step"] > state.global_step for r in read_metrics(self.path)):
                # the file holds steps beyond where this run starts (resume from an earlier checkpoint,
                # or a fresh run into an old directory): mark the first new line so readers drop them
                self._resumed_from = int(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._resolve_dir(args)
        self.write(state, logs)

    def write(self, state, logs: dict[str, Any] | None) -> None:
        """Append one record of ``logs`` at ``state.global_step`` (on the main process; a no-op elsewhere and
        before the output directory is known)."""
        if not state.is_world_process_zero or self.path is None:
            return
        if self._t0 is None:  # logging outside train() (e.g. a standalone evaluate())
            self._t0 = time.perf_counter()
        record: dict[str, Any] = {
            "step": int(state.global_step),
            "epoch": finite_or_none(to_float(state.epoch)) if state.epoch is not None else None,
            "time": round(self._time_offset + time.perf_counter() - self._t0, 3),
        }
        for key, value in (logs or {}).items():
            if key in ("step", "time"):
                continue
            if key == "epoch":
                v = to_float(value)
                if v is not None:
                    record["epoch"] = finite_or_none(v)
                continue
            v = to_float(value)
            if v is None:
                continue
            if float(v).is_integer() and isinstance(value, int) and not isinstance(value, bool):
                record[str(key)] = int(value)
            else:
                record[str(key)] = finite_or_none(v)
        if self._resumed_from is not None:
            record["resumed_from"] = self._resumed_from
            self._resumed_from = None
        line = json.dumps(record, allow_nan=False, ensure_ascii=False)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
