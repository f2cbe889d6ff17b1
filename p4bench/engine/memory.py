"""Keep freed memory in the process instead of handing it back to the kernel.

A batched round allocates and frees many temporaries of hundreds of MB (one per
client-stacked parameter set or batch). glibc serves such sizes with fresh `mmap`s and
unmaps them on free, so every step the kernel faults their pages in again, one 4 KiB
page at a time: on a small VM that costs more than the arithmetic (for example 15
million page faults and a minute of system time in `bench/p4.py`). Telling the
allocator to serve large blocks from its heap and never to trim it makes freed blocks
reusable without faults. PyTorch's documentation suggests jemalloc or tcmalloc for the
same reason; this needs neither.

The price is that the process keeps its peak heap until it exits, which suits a
simulation process. Set ``P4BENCH_KEEP_HEAP=0`` to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the policy once per process (glibc on Linux only). Returns whether it is in force."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("P4BENCH_KEEP_HEAP", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # -1: never trim the heap top (mallopt(3)); grow it 64 MiB at a time; no mmap-served blocks
    _applied = bool(
        mallopt(M_TRIM_THRESHOLD, -1) and mallopt(M_TOP_PAD, 64 << 20) and mallopt(M_MMAP_MAX, 0)
    )
    return _applied
