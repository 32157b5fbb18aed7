"""Medians, percentiles (linear interpolation) and ratios of benchmark figures."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return percentile(present, 50) if present else None


def summarize(values: Sequence[float], digits: int = 3) -> dict[str, float | int | None]:
    """n, min, p50, p90, p99, max and mean of a sample."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "n": len(values),
        "min": rounded(min(values)) if values else None,
        "p50": rounded(percentile(values, 50)),
        "p90": rounded(percentile(values, 90)),
        "p99": rounded(percentile(values, 99)),
        "max": rounded(max(values)) if values else None,
        "mean": rounded(sum(values) / len(values)) if values else None,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)
