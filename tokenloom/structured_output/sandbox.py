"""The server's side of the grammar worker (`worker.py`): one child process, one job at a time.

`GrammarSandbox.run(kind, spec, limits, timeout)` sends a grammar to the worker and returns its
report. When the worker dies on a grammar (signal 11 from a stack overflow, an abort, the OOM
killer) or does not answer within `timeout`, the job fails with a ValueError naming what happened,
the worker is killed and replaced on the next job, and the server carries on.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from . import worker
from .worker import write_frame

logger = logging.getLogger("tokenloom.grammar")

_START_TIMEOUT_S = 60.0
_DIED, _TIMED_OUT = object(), object()  # building the tokenizer in the worker takes ~0.3 s; a loaded machine, more


class GrammarSandbox:
    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos: list[int]):
        """`tokenizer_json`: makes the tokenizer's JSON for each worker started (not held in between)."""
        self._tokenizer_json = tokenizer_json
        self._setup = {"vocab_size": vocab_size, "eos": eos}
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one job at a time: the worker has one pipe
        self.num_restarts = 0  # workers replaced after a crash or a timeout (tests, reliability report)

    def run(self, kind: str, spec, limits: dict, timeout: float) -> dict:
        """The worker's report for one grammar; ValueError if the worker crashed or ran out of time."""
        with self._lock:
            proc = self._ensure_started()
            try:
                write_frame(proc.stdin, {"kind": kind, "spec": spec, "limits": limits})
                reply = self._read(proc, timeout)
            except BrokenPipeError:
                reply = _DIED
            if isinstance(reply, dict):
                return reply
            why = self._kill(proc, timed_out=reply is _TIMED_OUT)
            raise ValueError(f"structured_outputs.{kind}: {why}")

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)

    def _ensure_started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            self.num_restarts += 1
        self._proc = subprocess.Popen([sys.executable, worker.__file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, close_fds=True)
        write_frame(self._proc.stdin, {"tokenizer_json": self._tokenizer_json(), **self._setup})
        if not isinstance(reply := self._read(self._proc, _START_TIMEOUT_S), dict):
            why = self._kill(self._proc, timed_out=reply is _TIMED_OUT)
            raise RuntimeError(f"the grammar worker did not start: {why}")  # noqa: TRY004 - a server fault, a 500
        return self._proc

    def _read(self, proc: subprocess.Popen, timeout: float) -> dict | object:
        """One reply frame, or _DIED / _TIMED_OUT."""
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        data = b""
        need = 4
        size = None
        while len(data) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return _TIMED_OUT
            chunk = os.read(fd, need - len(data))
            if not chunk:
                return _DIED
            data += chunk
            if size is None and len(data) == 4:
                size = int.from_bytes(data, "big")
                need = 4 + size
        return json.loads(data[4:])

    def _kill(self, proc: subprocess.Popen, timed_out: bool = True) -> str:
        """Why the worker stopped answering (it is killed if still alive, then reaped)."""
        code = None
        if not timed_out:  # its pipe closed: it is exiting, collect how
            try:
                code = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if code is None:
            proc.kill()
            proc.wait()
            why = "the grammar took longer to compile than max_grammar_compile_seconds allows"
        elif code < 0:
            why = f"the grammar compiler crashed on this grammar ({signal.Signals(-code).name}); simplify it"
        else:
            why = f"the grammar compiler exited ({code}) on this grammar; simplify it"
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        logger.warning("grammar worker replaced: %s", why)
        self._proc = None
        self.num_restarts += 1
        return why
