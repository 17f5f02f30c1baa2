"""This process's memory as the OS counts it: resident bytes now, freed heap handed back, and large
zeroed buffers that take no time to make.

glibc keeps freed memory for reuse, and its dynamic mmap threshold moves large allocations onto the
heap after the first frees, so freed buffers (a grammar job's, an unloaded model's) stay in RSS until
`release_free_heap`; a resident-memory delta is one caller's own only after it. (The grammar worker
keeps two lines of its own for the same: it imports nothing of this package.)
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_heap() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back this way
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on fresh anonymous pages: the OS gives them zeroed when first touched, so a large
    pool (a KV cache of hundreds of MiB) is made at once instead of written through by `torch.zeros`, and
    its pages become resident as they are used. The tensor keeps the mapping; it is unmapped with it."""
    import torch  # here: the CLI imports this module before it needs torch
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
