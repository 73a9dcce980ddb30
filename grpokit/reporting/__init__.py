"""Run reporting: training-curve plots and a Markdown/JSON report (eval before/after with confidence intervals,
curves, config, samples). The callbacks that write ``metrics.jsonl`` and the live display are in
:mod:`grpokit.callbacks`."""

from ._util import read_metrics
from .plots import make_plots
from .report import compute_improvement, md_escape, write_report
from .stats import mean_ci95, wilson_interval
from .tables import log_completions_table

__all__ = [
    "compute_improvement",
    "log_completions_table",
    "make_plots",
    "md_escape",
    "mean_ci95",
    "read_metrics",
    "wilson_interval",
    "write_report",
]
