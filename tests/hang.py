"""How long a test waits for a child process before calling it hung.

These bounds catch hangs only: they are far above what the work takes on a slow, loaded 2-core machine (the
longest, a two-process ZeRO-3 run, takes about a minute on a quiet one), so no test fails for being slow."""

HANG_S = 1800
