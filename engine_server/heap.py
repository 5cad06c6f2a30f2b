"""The CPU engine's process heap: steady step times on the CPU.

glibc serves a block above its mmap threshold (128 KiB at first, raised as such blocks are
freed) with a fresh mmap and unmaps it when freed, and gives freed memory at the heap's top
back to the kernel past its trim threshold. Depending on the process's history of allocations,
a step's larger temporaries (a prefill's attention scores, say) may then land on pages the kernel
must fault in and zero again in every step: on the shrunk Llama preset 2 of 6 fresh engine
processes did, in each of two runs (80-180 page faults a prefill step, its 90th-percentile step
1.3-1.5x its median); with the heap kept none of 12 did (benchmarks/heap_bench.py,
benchmarks/results/cpu_heap_*.json).
`keep_heap` sets the thresholds so freed memory stays in the heap and is reused: the first
steps fault their pages in, later ones reuse them. The process's resident memory stays at its
peak instead of shrinking back. A no-op where the C library has no `mallopt` (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
KEEP = 1 << 30  # freed memory kept up to this much at the heap's top; blocks below it from the heap
TOP_PAD = 64 << 20  # each growth of the heap asks for this much more
MMAP_MAX_OLD = 32 << 20  # what older glibc accepts as the mmap threshold at most


def keep_heap() -> bool:
    """Keep freed memory in this process's heap and take large blocks from it (glibc's mallopt:
    trim threshold and mmap threshold KEEP, top pad TOP_PAD; the mmap threshold falls back to
    MMAP_MAX_OLD where KEEP is refused). Process-wide, idempotent. Returns whether it took."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = mallopt(M_MMAP_THRESHOLD, KEEP) or mallopt(M_MMAP_THRESHOLD, MMAP_MAX_OLD)
    return bool(mapped and mallopt(M_TRIM_THRESHOLD, KEEP) and mallopt(M_TOP_PAD, TOP_PAD))
