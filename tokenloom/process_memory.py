"""This process's memory as the OS counts it: resident bytes now, and freed heap handed back.

glibc keeps freed memory for reuse, and its dynamic mmap threshold moves large allocations onto the
heap after the first frees, so freed buffers (a grammar job's, an unloaded model's) stay in RSS until
`release_free_heap`; a resident-memory delta is one caller's own only after it. (The grammar worker
keeps two lines of its own for the same: it imports nothing of this package.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_heap() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back this way
        ctypes.CDLL("libc.so.6").malloc_trim(0)
