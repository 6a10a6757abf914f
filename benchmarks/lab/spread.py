"""How a result varies over seeds: one summary for every benchmark that reports seeds and spread."""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict[str, float]:
    """The mean, min, max and sample standard deviation (0.0 for one value) of ``values`` (not empty)."""
    if not values:
        raise ValueError("spread of no values: a benchmark reports a spread over at least one seed")
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }
