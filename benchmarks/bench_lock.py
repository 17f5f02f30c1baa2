"""One benchmark at a time on a shared 2-core machine: /work/notes/BENCH_LOCK exists while one runs.

A benchmark waits for the file to go, then holds it for its run; helpers' test runs wait on it too.
A batch of benchmarks run under one lock (scripts/bench_batch.sh) sets BENCH_LOCK_HELD=1 for them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

LOCK = Path("/work/notes/BENCH_LOCK")


@contextlib.contextmanager
def holding_lock():
    if os.environ.get("BENCH_LOCK_HELD") == "1":
        yield
        return
    while LOCK.exists():
        print("waiting: another benchmark holds", LOCK, flush=True)
        time.sleep(20)
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    LOCK.write_text(f"{Path(sys.argv[0]).name}, pid {os.getpid()}\n")
    try:
        yield
    finally:
        LOCK.unlink(missing_ok=True)
