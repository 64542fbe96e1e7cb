"""What every benchmark script shares: medians of timed calls after a warm-up, and peak memory."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import random
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


def add_clock_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--clock wall|thread`` and ``--warm`` to a benchmark's command line (read them with :func:`clock_of`
    and ``args.warm``, for :func:`interleaved_medians`)."""
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="wall time, or this thread's CPU time (steadier on a loaded machine: other processes do not stretch it)",
    )
    parser.add_argument(
        "--warm", action="store_true", help="time each call after an untimed one of the same method, as in a loop"
    )


def clock_of(args: argparse.Namespace) -> Callable[[], float]:
    """The clock ``--clock`` names (see :func:`add_clock_options`)."""
    return time.perf_counter if args.clock == "wall" else time.thread_time


def interleaved_medians(
    methods: dict[str, Callable[[], object]],
    repeats: int,
    collect: bool = False,
    clock: Callable[[], float] = time.perf_counter,
    warm: bool = False,
    loop: int = 1,
) -> dict[str, float]:
    """Median wall time of each method over ``repeats`` rounds that run every method once, after a warm-up round.

    Interleaving spreads slow phases of a shared machine over all methods alike,
    so their ratios stay steady where back-to-back blocks would drift. With
    ``collect``, Python's garbage collector runs before each timed call (untimed),
    so that no method pays for the objects another one left behind. ``clock``
    reads the time: ``time.process_time`` gives the CPU time of this process
    instead, which other processes on a loaded machine do not stretch (of use for
    single-threaded work only). With ``warm``, each timed call follows an untimed call of the same method (after
    the collection): it finds the caches as a loop over many batches leaves them, not as the collector and the other
    methods did. With ``loop`` above 1, each timed turn runs the method ``loop`` times in a row and counts the mean
    of those calls, as a loop over the batches of a data set runs it (the collection, if any, before the first
    call only). The methods take their turns in a new order every round (drawn with a fixed seed): a method that
    always ran first, or right after another, would meet the caches that place leaves.
    """
    times: dict[str, list[float]] = {label: [] for label in methods}
    order = list(methods.items())
    shuffle = random.Random(0).shuffle
    for round_ in range(repeats + 1):
        shuffle(order)
        for label, fn in order:
            if collect:
                gc.collect()
            if warm and round_:
                fn()
            start = clock()
            for _ in range(loop):
                fn()
            if round_:
                times[label].append((clock() - start) / loop)
    return {label: statistics.median(values) for label, values in times.items()}


def peak_memory_mb(fn: Callable[[], object]) -> float:
    """Peak resident memory that one call of ``fn`` adds, in MiB, measured in a forked child process.

    The child starts with the parent's memory (model, inputs). It first hands
    back the free memory the parent's allocator kept resident (glibc's
    ``malloc_trim``; the call would reuse it unseen, and the figure would depend
    on what ran before) and resets its peak to its current size (a fork
    inherits the parent's); the figure is the peak after the call minus the
    size before it. Linux only.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, and leave without running the parent's cleanup
        try:
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # the peak resident size starts again from the current one
            before_kib = _status_kib("VmRSS")
            fn()
            os.write(write_end, str((_status_kib("VmHWM") - before_kib) / 1024).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        reported = pipe.read()
    os.waitpid(pid, 0)
    if not reported:
        raise RuntimeError("the child process measuring peak memory failed")
    return float(reported)


def _status_kib(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status``, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")
