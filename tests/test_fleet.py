"""A real fleet: `tokenloom serve --data-parallel-size 2` on a local Ray cluster with the bundled model,
driven by the openai SDK and httpx as one server would be (tests/test_server_api.py's checks, through
the router), then prefix-aware routing against round-robin, then a replica killed under load."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import subprocess
import time

import httpx
import openai
import pytest
from conftest_server import ServerProcess, scrape, wait_for

from tokenloom import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
KV_BLOCKS = 96  # per replica: 1,536 tokens, below the 2,048-token context, so one request can outgrow it


class FleetProcess(ServerProcess):
    """A fleet server; stopped with SIGTERM so it takes its Ray cluster down with it."""

    def __init__(self, args: list[str], replicas: list[str] = ("--data-parallel-size", "2"), **kwargs):
        super().__init__([*replicas, "--num-kv-blocks", str(KV_BLOCKS), *args], startup_timeout=300.0, **kwargs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        super().stop()


def replica_totals(url: str, name: str) -> tuple[dict[str, float], float]:
    """A metric's value per replica and the fleet's total line."""
    per, total = {}, None
    for key, value in scrape(url).items():
        base, _, labels = key.partition("{")
        if base != name:
            continue
        m = re.search(r'replica="([^"]+)"', labels)
        if m:
            per[m.group(1)] = value
        else:
            total = value
    return per, total


STALL_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def fleet():
    # Armed for the last test: a request marked STALLME hangs its replica's engine (others are untouched).
    os.environ["TOKENLOOM_FAULTS"] = "stall:STALLME"
    try:
        srv = FleetProcess(["--routing-policy", "prefix-aware", "--engine-stall-timeout", str(STALL_TIMEOUT_S)])
    finally:
        del os.environ["TOKENLOOM_FAULTS"]
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sdk(fleet):
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(real_llm):
    outs = real_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


def test_sdk_through_the_router_matches_one_engine(sdk, offline, real_llm):
    def one(i: int) -> tuple[str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            text = "".join(c.choices[0].text for c in sdk.completions.create(
                model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
        else:
            text = sdk.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12,
                                          temperature=0).choices[0].text
        return prompt, text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert all(text == offline[prompt] for prompt, text in results)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = real_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    chunks = list(sdk.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_metrics_per_replica_and_summed(fleet, sdk):
    for prompt in PROMPTS * 2:
        sdk.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=4, temperature=0)
    time.sleep(2.5)  # the replicas report every second
    per, total = replica_totals(fleet.url, "tokenloom:generation_tokens_total")
    assert len(per) == 2, per
    assert total == sum(per.values()) >= 32


def test_bad_requests_are_refused_not_bounced(fleet):
    with fleet.client() as http:
        too_long = http.post("/v1/completions", json={"prompt": [1] * 3000, "max_tokens": 1})
        assert too_long.status_code == 400 and "2048" in too_long.json()["error"]["message"]
        # Fits the context, not any replica's KV cache: the replica that gets it refuses it, as a 400.
        outgrows = http.post("/v1/completions", json={"prompt": [1] * 1500, "max_tokens": 200})
        assert outgrows.status_code == 400, outgrows.text
        assert outgrows.json()["error"]["param"] == "max_tokens" and "KV" in outgrows.json()["error"]["message"]
        bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400
        assert http.post("/v1/completions", json={"prompt": "x", "model": "nope"}).status_code == 404
        assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def _shared_prefix_workload(seed: int = 0) -> list[str]:
    """8 system prompts x 4 users, in a shuffled order (so round-robin cannot land each prefix on one
    replica by accident)."""
    systems = [f"You are assistant number {s}. " + " ".join(f"rule {s}.{k}: be precise and brief." for k in range(12))
               for s in range(8)]
    prompts = [f"{system}\nUser {u} asks: what is {u} + {s}?" for s, system in enumerate(systems) for u in range(4)]
    random.Random(seed).shuffle(prompts)
    return prompts


def _hit_rate(url: str, prompts: list[str]) -> float:
    """The fleet's prefix-cache hit rate (tokens) over sending `prompts`, 4 at a time."""
    def totals() -> tuple[float, float]:
        return (replica_totals(url, "tokenloom:prefix_cache_hits_total")[1],
                replica_totals(url, "tokenloom:prefix_cache_queries_total")[1])

    def send(prompt: str) -> int:
        return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                          timeout=120).status_code

    hits0, queries0 = totals()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert set(pool.map(send, prompts)) == {200}
    time.sleep(2.5)  # the replicas report every second
    hits, queries = totals()
    return (hits - hits0) / (queries - queries0)


def test_prefix_aware_routing_hits_the_cache_more_than_round_robin(fleet):
    prompts = _shared_prefix_workload()
    prefix_aware = _hit_rate(fleet.url, prompts)
    rr = FleetProcess(["--routing-policy", "round-robin"])
    try:
        round_robin = _hit_rate(rr.url, prompts)
    finally:
        rr.stop()
    # 8 prefixes: prefix-aware misses each once (8 of 32); round-robin about once per replica (16 of 32).
    assert prefix_aware > round_robin + 0.1, (prefix_aware, round_robin)


def _engine_replica_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ServeReplica:tokenloom:engine"], capture_output=True, text=True,
                         check=False).stdout
    return [int(p) for p in out.split()]


def test_a_killed_replica_loses_no_request_silently(fleet):
    # (a fleet stopped by an earlier test takes a few seconds to end its replicas)
    assert wait_for(lambda: len(_engine_replica_pids()) == 2, 60), _engine_replica_pids()
    pids = _engine_replica_pids()

    def stream(i: int) -> str:
        body = {"prompt": PROMPTS[i % 4], "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    return f"http {r.status_code}"
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as exc:
            return f"transport {type(exc).__name__}"
        if events[-1] != "[DONE]":
            return "no [DONE]"
        payloads = [json.loads(e) for e in events[:-1]]
        if any("error" in p for p in payloads):
            return "error event"
        reasons = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
        return "completed" if reasons == ["length"] else f"silently cut: {reasons}"

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(stream, i) for i in range(12)]
        time.sleep(1.5)  # requests on both replicas, some tokens out
        os.kill(pids[0], signal.SIGKILL)
        outcomes = [f.result(timeout=180) for f in futures]
    assert all(o in ("completed", "error event", "http 503") for o in outcomes), outcomes
    assert "completed" in outcomes  # the other replica's requests went on

    # The endpoint keeps serving, and Ray brings the fleet back to two replicas.
    with fleet.client() as http:
        assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    assert wait_for(lambda: len(_engine_replica_pids()) == 2 and pids[0] not in _engine_replica_pids(), 120)
    assert wait_for(lambda: len(replica_totals(fleet.url, "tokenloom:generation_tokens_total")[0]) == 2, 120)


def test_a_hung_replica_is_taken_out_of_rotation_and_replaced(fleet):
    """One replica's engine hangs inside a step (an injected stall, for the request marked STALLME): the
    replica says so within --engine-stall-timeout, the router sends everything else to the other one,
    and Ray Serve's health check replaces it. (Last in the module: it leaves a replica being replaced.)"""
    assert wait_for(lambda: len(_engine_replica_pids()) == 2, 120)
    before = set(_engine_replica_pids())
    with pytest.raises(httpx.TimeoutException):  # the client gives up; its replica stays hung
        httpx.post(f"{fleet.url}/v1/completions", json={"prompt": "STALLME please", "max_tokens": 4}, timeout=2)
    time.sleep(STALL_TIMEOUT_S + 3)  # the stall timeout, then a report and a read of the board
    with fleet.client(timeout=60) as http:
        assert http.get("/health").status_code == 200  # one replica serves
        started = time.monotonic()
        for prompt in PROMPTS * 2:
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
        assert time.monotonic() - started < 50  # none waited on the hung replica
    # Ray's health check (every 2 s, 3 failures) replaces the hung replica's process.
    assert wait_for(lambda: len(set(_engine_replica_pids()) - before) == 1, 120), _engine_replica_pids()
