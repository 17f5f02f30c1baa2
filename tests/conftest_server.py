"""Shared helpers for the server tests: start a real `tokenloom serve` process and read /metrics.

The server runs in this session (no setsid: the kernel's autogroup would otherwise give it and the
test clients one core each) but in a process group of its own (the same autogroup), on a free
127.0.0.1 port, with its log in a temp file that is shown when it fails to come up. Every server
still running is killed, group and all, when the test process ends: a fixture's teardown, exit
(atexit), or a SIGTERM / SIGHUP to pytest (`end_all_servers`, installed when this module is
imported), so an interrupted run leaves no `tokenloom serve` behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import ClassVar

import httpx

# Small and quick on 2 shared cores: 256 MiB of KV (~5.8k tokens), a context that fits in it.
BASE_ARGS = ["--quantization", "none", "--max-num-seqs", "32", "--kv-cache-memory-bytes", "268435456", "--max-model-len", "2048",
             "--log-interval", "5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RUNNING: set[subprocess.Popen] = set()  # servers started and not yet stopped


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # the server and anything it started (its group is its pid)


def end_all_servers() -> None:
    for proc in list(_RUNNING):
        _kill_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
            proc.wait(timeout=10)
        _RUNNING.discard(proc)


def _on_signal(signum, frame) -> None:
    end_all_servers()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # then end as the signal would have ended us


def _install_cleanup() -> None:
    atexit.register(end_all_servers)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


_install_cleanup()


class ServerProcess:
    # url -> the Authorization header `scrape` sends there (/metrics is behind the key when one is set)
    scrape_headers: ClassVar[dict[str, dict[str, str]]] = {}

    def __init__(self, args: list[str], api_key: str | None = None, startup_timeout: float = 180.0,
                 metrics_token: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.metrics_token = metrics_token
        scrape_secret = metrics_token or api_key
        if scrape_secret:
            ServerProcess.scrape_headers[self.url] = {"Authorization": f"Bearer {scrape_secret}"}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tokenloom-serve-", suffix=".log", delete=False)  # noqa: SIM115 - lives as long as the server
        cmd = self.command(args)
        if api_key:
            cmd += ["--api-key", api_key]
        if metrics_token:
            cmd += ["--metrics-token", metrics_token]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("TOKENLOOM_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, process_group=0)
        _RUNNING.add(self.proc)
        self._wait_healthy(startup_timeout)

    def command(self, args: list[str]) -> list[str]:
        """The server's command line, on `self.port` (a subclass may start it another way)."""
        return [sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(self.port), *BASE_ARGS, *args]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def log_text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_text()[-4000:]}")

    def stop(self) -> None:
        _kill_group(self.proc)  # also what it started, even if it has exited itself
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        _RUNNING.discard(self.proc)
        self.log.close()
        os.unlink(self.log.name)


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}; label order as the server prints it."""
    text = httpx.get(f"{base_url}/metrics", headers=ServerProcess.scrape_headers.get(base_url), timeout=10.0).text
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
