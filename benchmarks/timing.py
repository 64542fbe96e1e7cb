"""What every benchmark script shares: the median of timed calls after a warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Call ``fn`` once to warm up, then ``repeats`` times; the median wall time of those calls."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(methods: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each method over ``repeats`` rounds that run every method once, after a warm-up round.

    Interleaving spreads slow phases of a shared machine over all methods alike,
    so their ratios stay steady where back-to-back blocks would drift.
    """
    times: dict[str, list[float]] = {label: [] for label in methods}
    for round_ in range(repeats + 1):
        for label, fn in methods.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in times.items()}
