"""Statistics for benchmarks: percentiles, latency summaries, medians and spread
across repetitions, (paired) ratios, and number formatting for tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def latency_summary(lat_s: Sequence[float]) -> dict[str, float]:
    """Seconds in, milliseconds out."""
    return {
        "n": len(lat_s),
        "p50_ms": percentile(lat_s, 50) * 1e3,
        "p90_ms": percentile(lat_s, 90) * 1e3,
        "p99_ms": percentile(lat_s, 99) * 1e3,
        "mean_ms": (sum(lat_s) / len(lat_s) * 1e3) if lat_s else math.nan,
        "max_ms": (max(lat_s) * 1e3) if lat_s else math.nan,
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and spread of one metric across repetitions."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "rel_spread": math.nan, "reps": 0}
    m = median(vals)
    return {
        "median": m,
        "min": min(vals),
        "max": max(vals),
        # (max - min) / median: how much the repetitions disagree
        "rel_spread": (max(vals) - min(vals)) / m if m else math.nan,
        "reps": len(vals),
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Per-repetition ratios num[i]/den[i] (measured side by side), summarized."""
    return spread([ratio(a, b) for a, b in zip(num, den, strict=True)])


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{nd}f}"
    return str(v)


def fmt_spread(s: dict[str, float], nd: int = 2) -> str:
    """'median [min–max]'."""
    if not s or s.get("reps", 0) == 0:
        return "-"
    if s["reps"] == 1:
        return fmt(s["median"], nd)
    return f"{fmt(s['median'], nd)} [{fmt(s['min'], nd)}-{fmt(s['max'], nd)}]"


# -------------------------------------------------------------- measuring
