"""Handing the memory that freed tensors leave in the C heap back to the system, between tests.

glibc's ``malloc`` serves allocations above its mmap threshold with ``mmap`` and raises that threshold (up to
32 MiB) each time such a block is freed, so that a process that allocates and frees large tensors soon serves them
from its heap. Freed, they stay in the heap, counted in the process's resident set, wherever a block still in use
lies above them: a test that builds a large model leaves gigabytes behind it that the next test cannot use for
anything but the same sizes, and a pytest worker's resident set grows to the sum of the largest tests it ran.
``malloc_trim(0)`` gives every free page of the heap back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["release_freed_memory"]


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (macOS, musl, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the system; whether the C library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
