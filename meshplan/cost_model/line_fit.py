"""A straight line fitted to measurements whose intercept and slope cannot be negative.

Two figures of the cost model are such lines: a collective's alpha + bytes x beta (`profiling/comm_profiler.py`)
and the in-program overhead per op run, a + r x the op's isolated seconds (`Profile.overhead_line`). A negative
latency, rate or overhead is noise, not physics: where least squares gives one, the other coefficient is fitted alone.
"""

from __future__ import annotations

from collections.abc import Sequence


def nonnegative_line(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None) -> tuple[float, float] | None:
    """(intercept, slope) of the weighted least-squares line through (xs, ys); with a slope below zero, the flat line
    at the weighted mean; with an intercept below zero, the line through the origin. None when the xs do not differ."""
    w = [1.0] * len(xs) if weights is None else list(weights)
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    if det <= 0:
        return None
    slope = (sw * sxy - sx * sy) / det
    intercept = (sy - slope * sx) / sw
    if slope < 0:
        return max(sy / sw, 0.0), 0.0
    if intercept < 0:
        return 0.0, max(sxy / sxx, 0.0)
    return intercept, slope
