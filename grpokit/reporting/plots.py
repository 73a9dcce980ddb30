"""PNG training curves from metrics.jsonl (matplotlib, Agg canvas; pyplot is never imported)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from ._util import read_metrics, series

PLOT_FILES = ("reward.png", "heldout_accuracy.png", "completion_length.png", "clipping.png", "entropy.png", "kl.png",
              "step_time.png")
CLIP_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")
PHI_KEY = "vespo/phi_seq_mean"

_SMOOTH_MIN_POINTS = 25


def moving_average(values: list[float], window: int) -> list[float]:
    """Centered moving average with shrinking windows at the edges."""
    n = len(values)
    if window <= 1 or n == 0:
        return list(values)
    half = window // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(n):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def _window(n: int) -> int:
    return 1 if n < _SMOOTH_MIN_POINTS else max(3, (n // 15) | 1)


def _new_axes(title: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title, fontsize=13, fontweight="bold")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, linestyle="--", linewidth=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def _line(ax, xs, ys, label, color=None, smooth=True, lw=2.0):
    """Plot a series: raw (faint) + moving average when there are many points, else raw with markers."""
    w = _window(len(xs)) if smooth else 1
    marker = "o" if len(xs) <= 30 else None
    if w > 1:
        (raw,) = ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1.0)
        ax.plot(xs, moving_average(ys, w), color=raw.get_color(), linewidth=lw, label=label)
        _note_smoothing(ax, w)
        return raw.get_color()
    (ln,) = ax.plot(xs, ys, color=color, linewidth=lw, marker=marker, markersize=3.5, label=label)
    return ln.get_color()


def _note_smoothing(ax, w: int) -> None:
    fig = ax.get_figure()
    if getattr(fig, "_grpokit_smooth_note", False):
        return
    fig._grpokit_smooth_note = True
    fig.text(0.995, 0.005, f"bold: {w}-step moving average, faint: raw", ha="right", va="bottom",
             fontsize=7, color="0.45")


def _band(ax, xs, lo, hi, color, label, smooth=True):
    w = _window(len(xs)) if smooth else 1
    if w > 1:
        lo, hi = moving_average(lo, w), moving_average(hi, w)
    ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0, label=label)


def _paired(records, a: str, b: str):
    """Steps where both keys are finite, with their values."""
    xs, ya, yb = [], [], []
    for r in records:
        va, vb = r.get(a), r.get(b)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (va, vb)):
            xs.append(r["step"])
            ya.append(float(va))
            yb.append(float(vb))
    return xs, ya, yb


def _save(fig, ax, path: Path, legend=True) -> Path:
    if legend and len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(loc="best", fontsize=8, framealpha=0.85)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _reward_plot(records, out: Path) -> Path | None:
    xs, ys = series(records, "reward")
    names = sorted({k for r in records for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    if not xs and not any(series(records, k)[0] for k in names):
        return None
    fig, ax = _new_axes("Reward", "reward (train batch)")
    if xs:
        color = _line(ax, xs, ys, "reward", color="C0", lw=2.4)
        bx, mean, std = _paired(records, "reward", "reward_std")
        if bx:
            _band(ax, bx, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                  color, "± reward_std")
    for i, key in enumerate(names):
        kx, ky = series(records, key)
        if kx:
            _line(ax, kx, ky, key[len("rewards/"):-len("/mean")], color=f"C{i + 1}", lw=1.4)
    return _save(fig, ax, out)


def _length_plot(records, out: Path) -> Path | None:
    xs, ys = series(records, "completions/mean_length")
    if not xs:
        return None
    fig, ax = _new_axes("Completion length", "tokens")
    color = _line(ax, xs, ys, "mean length", color="C2")
    bx, lo, hi = _paired(records, "completions/min_length", "completions/max_length")
    if bx:
        _band(ax, bx, lo, hi, color, "min–max", smooth=False)
    return _save(fig, ax, out)


def _clipping_plot(records, out: Path) -> Path | None:
    present = [k for k in CLIP_KEYS if series(records, k)[0]]
    phi = series(records, PHI_KEY)
    if not present and not phi[0]:
        return None
    fig, ax = _new_axes("Clipping / importance-weight control",
                        "fraction clipped" if present else "phi (sequence mean)")
    for i, key in enumerate(present):
        kx, ky = series(records, key)
        _line(ax, kx, ky, key, color=f"C{i}")
    if phi[0]:
        target = ax
        if present:  # different scale: put phi on a secondary axis
            target = ax.twinx()
            target.set_ylabel("vespo phi (sequence mean)")
            target.spines["top"].set_visible(False)
        _line(target, phi[0], phi[1], PHI_KEY, color="C4")
        if target is not ax:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = target.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, loc="best", fontsize=8, framealpha=0.85)
            return _save(fig, ax, out, legend=False)
    return _save(fig, ax, out)


def _held_out_plot(points, out: Path) -> Path | None:
    if len(points) < 2:
        return None
    fig, ax = _new_axes("Accuracy on held-out questions", "accuracy (greedy)")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    err = [[a - lo for _, a, lo, _ in points], [hi - a for _, a, _, hi in points]]
    ax.errorbar(xs, ys, yerr=err, color="C1", marker="o", markersize=5, capsize=4, linewidth=2,
                label="accuracy (bars: 95% CI)")
    ax.set_ylim(0, 1)
    return _save(fig, ax, out)


def _simple_plot(records, key, title, ylabel, color, out: Path) -> Path | None:
    xs, ys = series(records, key)
    if not xs:
        return None
    fig, ax = _new_axes(title, ylabel)
    _line(ax, xs, ys, key, color=color)
    return _save(fig, ax, out)


def make_plots(metrics_path: str | os.PathLike, out_dir: str | os.PathLike,
               held_out: list[tuple[int, float, float, float]] | None = None) -> list[Path]:
    """Render training curves from ``metrics_path`` (metrics.jsonl) into ``out_dir``.

    Produces (each only when its keys were logged): ``reward.png`` (reward ± reward_std band and
    each ``rewards/<name>/mean``), ``heldout_accuracy.png`` (``held_out``'s points, from
    :func:`grpokit.reporting.report.held_out_points`,
    when there are two or more), ``completion_length.png`` (mean, min–max band), ``clipping.png``
    (clip ratios / CISPO clip ratio / VESPO phi), ``entropy.png``, ``kl.png``, ``step_time.png``.
    Series with many points get a faint raw line plus a moving average. Returns the written paths;
    an empty, missing or unparseable file gives ``[]``.
    """
    records = read_metrics(metrics_path)
    if not records:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    makers = [
        lambda: _reward_plot(records, out_dir / "reward.png"),
        lambda: _held_out_plot(held_out or [], out_dir / "heldout_accuracy.png"),
        lambda: _length_plot(records, out_dir / "completion_length.png"),
        lambda: _clipping_plot(records, out_dir / "clipping.png"),
        lambda: _simple_plot(records, "entropy", "Policy entropy", "entropy (nats / token)", "C5",
                             out_dir / "entropy.png"),
        lambda: _simple_plot(records, "kl", "KL divergence to reference", "KL", "C3", out_dir / "kl.png"),
        lambda: _simple_plot(records, "step_time", "Step time", "seconds / step", "C7",
                             out_dir / "step_time.png"),
    ]
    return [p for p in (m() for m in makers) if p is not None]
