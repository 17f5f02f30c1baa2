"""Start one server for a benchmark cell and stop it (with its children), servers taking turns.

A server is not started in a new session: the kernel's autogroups would then split the cores between
it and the load generator (measured: half of tokenloom's throughput at 32 streams).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx


def start_server(cmd: list[str], port: int, log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start `cmd` (logging to `log`) and wait until /health and /v1/models answer 200."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    for _ in range(2400):
        try:
            if (httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
                    and httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200):
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    stop(proc)
    raise RuntimeError(f"server {cmd} did not start (log: {log})")


def stop(proc: subprocess.Popen) -> None:
    """The server and its children (vLLM's engine runs in one)."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False).stdout.split()
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    time.sleep(2)  # the cores settle before the next server
