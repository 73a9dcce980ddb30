"""Run reporting: metrics.jsonl logging, a rich progress display, training-curve plots and a
Markdown/JSON report (eval before/after with confidence intervals, curves, config, samples)."""

from ._util import read_metrics
from .plots import make_plots
from .report import compute_improvement, md_escape, write_report
from .stats import mean_ci95, wilson_interval
from .tables import log_completions_table

_LAZY = {"MetricsJsonlCallback", "ProgressCallback", "format_log_line"}


def __getattr__(name):  # the callbacks import transformers (slow); load them only when asked for
    if name in _LAZY:
        from . import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MetricsJsonlCallback",
    "ProgressCallback",
    "compute_improvement",
    "format_log_line",
    "log_completions_table",
    "make_plots",
    "md_escape",
    "mean_ci95",
    "read_metrics",
    "wilson_interval",
    "write_report",
]
