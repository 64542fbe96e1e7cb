"""What every benchmark script shares: medians of timed calls after a warm-up, and peak memory."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
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


def peak_memory_mb(fn: Callable[[], object]) -> float:
    """Peak resident memory that one call of ``fn`` adds, in MiB, measured in a forked child process.

    The child starts with the parent's memory (model, inputs); the figure is its
    peak resident set size minus its size before the call. Free memory the
    parent's allocator kept resident is first handed back (glibc's
    ``malloc_trim``), or the call would reuse it unseen and the figure would
    depend on what ran before. Linux only.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, and leave without running the parent's cleanup
        try:
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/statm") as statm:
                before_kib = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
            fn()
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            os.write(write_end, str((peak_kib - before_kib) / 1024).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        reported = pipe.read()
    os.waitpid(pid, 0)
    if not reported:
        raise RuntimeError("the child process measuring peak memory failed")
    return float(reported)
