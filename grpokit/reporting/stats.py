"""Confidence intervals used in reports."""

from __future__ import annotations

import math
from collections.abc import Iterable


def wilson_interval(successes: int | float, n: int | float, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion ``successes / n``.

    Unlike the normal ("Wald") interval it behaves well at 0% and 100% (e.g. 0/128 gives
    ``(0.0, 0.0291)``). Returns ``(0.0, 1.0)`` (no information) when ``n <= 0``.
    """
    n = float(n)
    if n <= 0:
        return (0.0, 1.0)
    k = min(max(float(successes), 0.0), n)
    p = k / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2.0 * n)) / denom
    half = (z / denom) * math.sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n))
    lo, hi = center - half, center + half
    # exact at the boundaries (avoid 1e-17 noise)
    if k == 0:
        lo = 0.0
    if k == n:
        hi = 1.0
    return (max(0.0, lo), min(1.0, hi))


def mean_ci95(values: Iterable[float]) -> tuple[float, float]:
    """Normal-approximation 95% interval for the mean: ``mean ± 1.96 * s / sqrt(n)`` (s: sample std).

    Non-finite values are ignored. One value gives ``(v, v)``; none gives ``(nan, nan)``.
    """
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return (math.nan, math.nan)
    mean = math.fsum(xs) / n
    if n == 1:
        return (mean, mean)
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    half = 1.96 * math.sqrt(var / n)
    return (mean - half, mean + half)
