"""Large host tensors reused from the heap instead of mapped afresh at every step.

glibc serves every block over its mmap threshold (which adapts up to 32 MiB) with a fresh
mapping and unmaps it when it is freed. A training step on a CPU frees and reallocates the
same large activations at every step, so each step faults all their pages in again: 118,000
page faults a step for ViT-S at 4,000 tokens, 7 % of its time (docs/benchmarks.md). With
both thresholds raised, freed blocks stay in the heap for the next step: the process keeps
its peak memory instead of handing it back between steps.
"""

from __future__ import annotations

import ctypes
import os

# mallopt's parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LARGEST = 2**31 - 1  # mallopt takes a C int


def glibc() -> bool:
    """Whether this process's C library is glibc."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process, and in processes it forks from
    now on (not DataLoader workers: they start from a forkserver, with glibc's defaults).
    False where the C library is not glibc (macOS, musl)."""
    if not glibc():
        return False
    libc = ctypes.CDLL(None)  # the process's own C library
    return all(libc.mallopt(parameter, LARGEST) == 1 for parameter in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
