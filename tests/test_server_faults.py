"""Fault injection against a real `tokenloom serve` process (TOKENLOOM_FAULTS, read at start-up):
a sampler fault and a detokenization fault each fail their request alone (a 500 OpenAI-shaped body,
or an SSE error event then [DONE]) while a concurrent request succeeds; a forward fault fails the
requests of its step and the server goes on serving correctly; a forward that fails at every step
makes the process exit non-zero (for a supervisor to restart) instead of living on as a 503 zombie.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest_server import ServerProcess

pytestmark = pytest.mark.slow

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def complete(srv: ServerProcess, prompt: str, stream: bool = False) -> httpx.Response:
    with srv.client() as c:
        return c.post("/v1/completions", json={"prompt": prompt, "stream": stream, **GREEDY})


def sse_events(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def faulty_server():
    import os

    old = os.environ.get("TOKENLOOM_FAULTS")
    os.environ["TOKENLOOM_FAULTS"] = "sampler:FAULT_SAMPLER,detok:FAULT_DETOK,forward:FAULT_FORWARD"
    try:
        srv = ServerProcess([])
    finally:
        if old is None:
            os.environ.pop("TOKENLOOM_FAULTS")
        else:
            os.environ["TOKENLOOM_FAULTS"] = old
    yield srv
    srv.stop()


def test_faults_fail_alone_and_server_keeps_serving(faulty_server):
    srv = faulty_server
    baseline = complete(srv, "The capital of France is")
    assert baseline.status_code == 200
    expected = baseline.json()["choices"][0]["text"]

    with ThreadPoolExecutor(4) as pool:
        # A sampler fault (non-streaming) next to a normal request: a 500 for it, a 200 for the other.
        bad = pool.submit(complete, srv, "FAULT_SAMPLER tell me a story")
        good = pool.submit(complete, srv, "The capital of France is")
        r = bad.result()
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "injected fault: sampler" in err["message"]
        assert good.result().status_code == 200 and good.result().json()["choices"][0]["text"] == expected

        # A detokenization fault (streaming): an SSE error event, then [DONE]; the neighbour streams fine.
        bad = pool.submit(complete, srv, "FAULT_DETOK tell me a story", True)
        good = pool.submit(complete, srv, "The capital of France is", True)
        r = bad.result()
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "injected fault: detok" in json.loads(events[-2])["error"]["message"]
        good_events = sse_events(good.result().text)
        assert good_events[-1] == "[DONE]" and "error" not in good.result().text
        assert "".join(json.loads(e)["choices"][0]["text"] for e in good_events[:-1]) == expected

        # A forward fault: its request fails (and whoever shared the step); the server goes on.
        r = complete(srv, "FAULT_FORWARD tell me a story")
        assert r.status_code == 500 and "injected fault: forward" in r.json()["error"]["message"]

    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
    after = complete(srv, "The capital of France is")
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected
    assert srv.proc.poll() is None
    log = srv.log_text()
    assert "request" in log and "failed" in log


def test_forward_failing_every_step_exits_nonzero():
    import os

    os.environ["TOKENLOOM_FAULTS"] = "forward:*"
    try:
        srv = ServerProcess([])
    finally:
        os.environ.pop("TOKENLOOM_FAULTS")
    try:
        statuses = []
        for _ in range(5):
            try:
                statuses.append(complete(srv, "Hello there").status_code)
            except httpx.HTTPError:
                break  # the process is gone
            if srv.proc.poll() is not None:
                break
        t0 = time.monotonic()
        code = srv.proc.wait(timeout=15)
        assert code == 1, srv.log_text()[-3000:]
        assert statuses and all(s in (500, 503) for s in statuses), statuses
        assert "exiting with status 1" in srv.log_text()
        print(f"\nforward failing every step: statuses {statuses}, exited {code} "
              f"{time.monotonic() - t0:.1f}s after the last response")
    finally:
        srv.stop()
