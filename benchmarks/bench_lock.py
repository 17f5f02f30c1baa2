"""One benchmark at a time on a shared 2-core machine: /work/notes/BENCH_LOCK exists while one runs.

A benchmark waits for the file to go, takes it, then waits for test runs already under way to end (a
helper checks the lock before it starts one, not during it) and holds the lock for its run.
A batch of benchmarks run under one lock (scripts/bench_batch.sh) sets BENCH_LOCK_HELD=1 for them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
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
        while subprocess.run(["pgrep", "-f", "bin/pytest"], capture_output=True, check=False).stdout:
            print("waiting: a test run is under way", flush=True)
            time.sleep(10)
        yield
    finally:
        LOCK.unlink(missing_ok=True)
