"""End-to-end lifecycle of a real server process: a full queue answers 503 + Retry-After, and
SIGTERM lets an in-flight request finish before the process exits 0.

The server admits one sequence at a time and queues at most one, so a third request overflows.
The SIGTERM test ends the module's server, so it runs last.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from conftest_server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--max-num-seqs", "1", "--max-queue-len", "1", "--shutdown-timeout", "60"])
    yield srv
    srv.stop()


def _stream_lines(url: str, body: dict, lines: list, started: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        lines.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
                started.set()
    started.set()


def test_full_queue_is_503_with_retry_after(server):
    # Long enough that the first request is still running when the third arrives, on any machine.
    body = {"prompt": "Count to one hundred:", "max_tokens": 256, "ignore_eos": True}
    running, queued = [], []
    first, second = threading.Event(), threading.Event()
    t1 = threading.Thread(target=_stream_lines, args=(server.url, body, running, first))
    t1.start()
    assert first.wait(60), "first request never started"
    t2 = threading.Thread(target=_stream_lines, args=(server.url, body, queued, second))
    t2.start()
    time.sleep(1.0)  # the second request is accepted (status 200 sent) and waits in the queue
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "queue_full" and "max_queue_len" in err["message"] and err["type"] == "server_error"
    t1.join(120)
    t2.join(120)
    assert running[0] == 200 and queued[0] == 200
    assert running[-1] == "[DONE]" and queued[-1] == "[DONE]"
    # Once the queue drained, requests are accepted again.
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_sigterm_lets_in_flight_request_finish_and_exits_0(server):
    lines: list = []
    started = threading.Event()
    body = {"prompt": "Write a long story:", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    t = threading.Thread(target=_stream_lines, args=(server.url, body, lines, started))
    t.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert server.proc.wait(timeout=90) == 0, server.log_text()[-3000:]
    assert lines[0] == 200 and lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[1:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    log = server.log_text()
    assert "shutting down" in log.lower()
    # One log line per finished request, with the numbers users look for.
    assert "finished (length): prompt" in log and "output 32 tokens, TTFT" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)
