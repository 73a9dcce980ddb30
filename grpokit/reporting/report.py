"""report.json + report.md for a finished run."""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Any

from ..run.files import atomic_write_text
from ._util import (
    HELD_OUT_KEYS,
    METRICS_FILENAME,
    as_text,
    fmt_duration,
    jsonable,
    read_metrics,
    to_float,
    truncate,
)
from .plots import make_plots
from .stats import wilson_interval

CONFIG_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model", "model_name_or_path", "model_id", "model_name")),
    ("loss_type", ("loss_type",)),
    ("importance_sampling_level", ("importance_sampling_level",)),
    ("learning_rate", ("learning_rate", "lr")),
    ("num_generations", ("num_generations",)),
    ("max_completion_length", ("max_completion_length",)),
    ("steps", ("steps", "max_steps")),
)


def md_escape(text: Any, limit: int | None = 200) -> str:
    """Make text safe for one markdown table cell: truncate, HTML-escape (so ``<think>`` stays
    visible), escape pipes, turn newlines into ``<br>``."""
    s = truncate(as_text(text), limit) if limit else as_text(text)
    s = html.escape(s, quote=False)
    s = s.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")
    s = s.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")
    return s


def _num(d: dict | None, key: str) -> float | None:
    if not d or key not in d:
        return None
    v = to_float(d[key])
    return v if v is not None and math.isfinite(v) else None


def accuracy_ci(ev: dict | None) -> tuple[float, float] | None:
    """``accuracy_ci95`` from the eval dict, or a Wilson interval from ``accuracy`` and ``n``."""
    if not ev:
        return None
    ci = ev.get("accuracy_ci95")
    if isinstance(ci, (list, tuple)) and len(ci) == 2:
        lo, hi = to_float(ci[0]), to_float(ci[1])
        if lo is not None and hi is not None:
            return (lo, hi)
    acc, n = _num(ev, "accuracy"), _num(ev, "n")
    if acc is not None and n:
        return wilson_interval(round(acc * n), int(n))
    return None


def held_out_points(records: list[dict], before: dict | None = None, after: dict | None = None,
                    final_step: int | None = None) -> list[tuple[int, float, float, float]]:
    """``(step, accuracy, ci_low, ci_high)`` of the held-out evaluations: ``before`` at step 0, those during
    training (the ``heldout/*`` records of metrics.jsonl), ``after`` at ``final_step``; in step order."""
    points = []
    if _num(before, "accuracy") is not None:
        points.append((0, before["accuracy"], *accuracy_ci(before)))
    for r in records:
        values = [_num(r, k) for k in HELD_OUT_KEYS]
        if None not in values:
            points.append((r["step"], *values))
    if _num(after, "accuracy") is not None and final_step is not None:
        points.append((final_step, after["accuracy"], *accuracy_ci(after)))
    return [(int(s), float(a), float(lo), float(hi)) for s, a, lo, hi in sorted(points, key=lambda p: p[0])]


def compute_improvement(before: dict | None, after: dict | None) -> dict | None:
    """after − before for ``reward_mean`` and ``accuracy``; ``accuracy_significant`` is True when
    after's 95% lower bound exceeds before's 95% upper bound (non-overlapping intervals)."""
    if not before or not after:
        return None
    out: dict[str, Any] = {}
    for key in ("reward_mean", "accuracy"):
        b, a = _num(before, key), _num(after, key)
        out[key] = None if a is None or b is None else round(a - b, 10)
    cb, ca = accuracy_ci(before), accuracy_ci(after)
    out["accuracy_significant"] = None if cb is None or ca is None else bool(ca[0] > cb[1])
    return out


def _final_metrics(records: list[dict]) -> dict:
    final: dict[str, Any] = {}
    for rec in records:
        for k, v in rec.items():
            if v is not None:
                final[k] = v
    return final


def _config_value(config: dict, aliases: tuple[str, ...]) -> Any:
    for scope in [config] + [v for v in config.values() if isinstance(v, dict)]:
        for key in aliases:
            if key in scope and scope[key] is not None:
                return scope[key]
    return None


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    f = to_float(v)
    if f is None:
        return md_escape(v, limit=120)
    if not math.isfinite(f):
        return "—"
    if float(f).is_integer() and not isinstance(v, float):
        return str(int(f))
    return f"{f:.{digits}f}" if abs(f) >= 1e-3 or f == 0 else f"{f:.2e}"


def _cfg_fmt(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:g}"
    return _fmt(v)


def _signed(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:+.{digits}f}"


def _acc_cell(ev: dict | None) -> str:
    acc = _num(ev, "accuracy")
    if acc is None:
        return "—"
    ci = accuracy_ci(ev)
    return f"{acc:.3f}" + (f" (ci95 [{ci[0]:.3f}, {ci[1]:.3f}])" if ci else "")


def _summary_md(before: dict | None, after: dict | None, improvement: dict | None) -> list[str]:
    imp = improvement or {}
    lines = ["| metric | before | after | Δ |", "|---|---|---|---|"]
    lines.append(f"| reward_mean | {_fmt(_num(before, 'reward_mean'))} | {_fmt(_num(after, 'reward_mean'))} "
                 f"| {_signed(imp.get('reward_mean'))} |")
    lines.append(f"| accuracy | {_acc_cell(before)} | {_acc_cell(after)} | {_signed(imp.get('accuracy'))} |")
    extra_keys = [k for k in dict.fromkeys([*(before or {}), *(after or {})])
                  if k not in ("reward_mean", "accuracy", "accuracy_ci95", "n", "seconds")
                  and not isinstance((before or {}).get(k, (after or {}).get(k)), bool)
                  and (_num(before, k) is not None or _num(after, k) is not None)]
    for k in extra_keys:
        b, a = _num(before, k), _num(after, k)
        d = None if a is None or b is None else a - b
        lines.append(f"| {md_escape(k, 60)} | {_fmt(b)} | {_fmt(a)} | {_signed(d)} |")
    lines.append(f"| n | {_fmt((before or {}).get('n'))} | {_fmt((after or {}).get('n'))} | |")
    sig = imp.get("accuracy_significant")
    if sig is not None:
        lines += ["", "Accuracy gain exceeds the 95% intervals (after's lower bound > before's upper bound): "
                  f"**{'yes' if sig else 'no'}**."]
    return lines


def _samples_md(title: str, samples: list[dict] | None) -> list[str]:
    if not samples:
        return []
    has_answer = any("answer" in s for s in samples)
    head = "| # | prompt | completion |" + (" answer |" if has_answer else "") + " reward |"
    lines = [f"### {title}", "", head, "|---|---|---|" + ("---|" if has_answer else "") + "---|"]
    for i, s in enumerate(samples, 1):
        row = f"| {i} | {md_escape(s.get('prompt'), 160)} | {md_escape(s.get('completion'), 200)} |"
        if has_answer:
            row += f" {md_escape(s.get('answer', ''), 60)} |"
        row += f" {_fmt(s.get('reward'))} |"
        lines.append(row)
    lines.append("")
    return lines


MOE_METRICS = (
    ("moe/rerouted_share", "tokens re-routed, share (mean over layers)"),
    ("moe/rerouted_any_layer", "tokens re-routed in some layer, share"),
    ("moe/ratio_std/rerouted", "training/inference ratio (π_θ / π_sampler) std, re-routed tokens"),
    ("moe/ratio_std/kept", "training/inference ratio std, other tokens"),
    ("moe/policy_ratio_std/rerouted", "policy ratio (π_θ / π_old) std, re-routed tokens"),
    ("moe/policy_ratio_std/kept", "policy ratio (π_θ / π_old) std, other tokens"),
    ("moe/load_imbalance", "expert load imbalance (E · max load; 1 = even)"),
)
"""The router metrics of a Mixture-of-Experts run (grpokit/moe/training.py), in the report when logged."""


def _moe_md(records: list[dict]) -> list[str]:
    """The router metrics over the run (mean of the logged values) and at its end; nothing for a dense model."""
    rows = []
    for key, label in MOE_METRICS:
        values = [v for v in (to_float(r.get(key)) for r in records) if v is not None]
        if values:
            rows.append(f"| {label} | {_fmt(sum(values) / len(values))} | {_fmt(values[-1])} |")
    if not rows:
        return []
    return ["## Mixture-of-Experts routing", "", "Between the sampler's routing (else the old log-probs' forward) "
            "and the training forward's own router (docs/algorithms.md).", "", "| metric | run mean | last |",
            "|---|---|---|", *rows, ""]


def write_report(output_dir: str | os.PathLike, *, config: dict, eval_before: dict | None,
                 eval_after: dict | None, samples_before: list[dict] | None, samples_after: list[dict] | None,
                 wall_time_s: float, train_time_s: float | None = None, extra: dict | None = None) -> Path:
    """Write ``report.json`` and ``report.md`` into ``output_dir`` (atomically) and return the .md path.

    Plots are (re)rendered from ``<output_dir>/metrics.jsonl`` when it exists; ``final_metrics`` holds
    the last logged value of every metric key.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / METRICS_FILENAME
    records = read_metrics(metrics_path)
    held_out = held_out_points(records, eval_before, eval_after, (config or {}).get("steps"))
    plots = [p.name for p in make_plots(metrics_path, out, held_out)] if records else []
    improvement = compute_improvement(eval_before, eval_after)
    config = config or {}

    report = {
        "config": config,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "improvement": improvement,
        "wall_time_s": wall_time_s,
        "train_time_s": train_time_s,
        "plots": plots,
        "held_out_accuracy": [dict(step=st, accuracy=a, ci95=[lo, hi]) for st, a, lo, hi in held_out],
        "final_metrics": _final_metrics(records),
        "extra": extra,
    }
    atomic_write_text(out / "report.json",
                      json.dumps(jsonable(report), indent=2, allow_nan=False, ensure_ascii=False) + "\n")

    model = _config_value(config, CONFIG_FIELDS[0][1])
    algo = _config_value(config, ("loss_type",))
    title = "Training report" + (f": {as_text(model)}" if model else "") + (f" ({algo})" if algo else "")
    md = [f"# {title}", ""]
    timing = f"Wall time: **{fmt_duration(wall_time_s)}**"
    if train_time_s is not None:
        timing += f" (training: {fmt_duration(train_time_s)})"
    md += [timing + ".", "", "## Evaluation", ""]
    if eval_before or eval_after:
        md += _summary_md(eval_before, eval_after, improvement)
    else:
        md.append("_No evaluation was run._")
    md.append("")
    if plots:
        md += ["## Training curves", ""]
        for name in plots:
            md += [f"![]({name})", ""]
    md += _moe_md(records)
    md += ["## Configuration", "", "| field | value |", "|---|---|"]
    for name, aliases in CONFIG_FIELDS:
        md.append(f"| {name} | {_cfg_fmt(_config_value(config, aliases))} |")
    md.append("")
    if samples_before or samples_after:
        md += ["## Sample completions", ""]
        md += _samples_md("Before training", samples_before)
        md += _samples_md("After training", samples_after)
    return atomic_write_text(out / "report.md", "\n".join(md).rstrip() + "\n")
