"""Every ``TrainerCallback`` grpokit installs, in one place:

- :mod:`.training`: :class:`TrainerHooks` (the trainer's own hooks into the loop), :class:`TimeBudget` and
  :class:`FollowFreeCores` (a job's torch threads follow the free cores);
- :mod:`.stall`: :class:`StallWatchdog` (``stall_timeout_s``: where a stuck run is stuck);
- :mod:`.interrupt`: :class:`GracefulInterrupt` (SIGINT/SIGTERM → checkpoint and stop);
- :mod:`.held_out`: :class:`HeldOutCurve` (held-out accuracy every few steps during training);
- :mod:`.metrics_file`: :class:`MetricsJsonlCallback` (``metrics.jsonl``);
- :mod:`.progress`: :class:`ProgressCallback` (the live bar and log lines) and :func:`format_log_line`.
"""

from .held_out import HeldOutCurve, held_out_record
from .interrupt import GracefulInterrupt
from .metrics_file import MetricsJsonlCallback
from .progress import ProgressCallback, format_log_line
from .stall import StallWatchdog
from .training import FollowFreeCores, TimeBudget, TrainerHooks, install_hooks

__all__ = ["FollowFreeCores", "GracefulInterrupt", "HeldOutCurve", "MetricsJsonlCallback", "ProgressCallback",
           "StallWatchdog", "TimeBudget", "TrainerHooks", "format_log_line", "held_out_record", "install_hooks"]
