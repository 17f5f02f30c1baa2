"""Server fixtures clean up (tests/conftest_server.py): a pytest run stopped with SIGTERM (or SIGHUP), or
one that just ends, leaves no server process behind, nor anything the server started (issue 57: a
`tokenloom serve` from a fixture was still alive 14 minutes after such a run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# A stand-in for `tokenloom serve`: answers /health and starts a child of its own (as a fleet starts Ray).
FAKE_SERVER = textwrap.dedent('''
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(f"{child.pid}\\n")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')

INNER_TEST = textwrap.dedent('''
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from conftest_server import ServerProcess

    class Fake(ServerProcess):
        def command(self, args):
            return [sys.executable, {fake!r}, str(self.port), {pids!r}]

    def test_hold_a_server():
        srv = Fake([], startup_timeout=60)
        open({ready!r}, "w").write(f"{{srv.proc.pid}}\\n")
        {body}
''')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _run_inner(tmp_path: Path, body: str, sig: int | None) -> tuple[int, int, int]:
    fake, ready, pids = tmp_path / "fake_server.py", tmp_path / "ready", tmp_path / "pids"
    fake.write_text(FAKE_SERVER)
    test = tmp_path / "test_inner.py"
    test.write_text(INNER_TEST.format(tests=str(Path(__file__).parent), fake=str(fake), ready=str(ready),
                                      pids=str(pids), body=body))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (ready.exists() and pids.exists() and ready.read_text().endswith("\n")
               and pids.read_text().endswith("\n")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()[-2000:]
        time.sleep(0.05)
    server, child = int(ready.read_text()), int(pids.read_text())
    assert _alive(server) and _alive(child)
    if sig is not None:
        proc.send_signal(sig)
    proc.wait(timeout=60)
    return proc.returncode, server, child


def _gone(*pids: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_pytest_leaves_no_server_behind(tmp_path, sig):
    code, server, child = _run_inner(tmp_path, "time.sleep(600)", sig)
    assert code == -sig  # it still ends as the signal ends it
    assert _gone(server, child), "the server or its child outlived pytest"


def test_a_run_that_ends_without_stopping_its_server_leaves_none_behind(tmp_path):
    code, server, child = _run_inner(tmp_path, "pass  # no srv.stop(): atexit ends it", None)
    assert code == 0
    assert _gone(server, child)
