"""A real fleet of 2 replicas on a local Ray cluster with the bundled model, deployed as `serve run
tokenloom.fleet.serve_run:build` deploys it (Ray Serve's HTTP proxy in front of the FleetIngress
deployment, which holds the router): driven by the openai SDK and httpx as one server would be
(tests/test_server_api.py's checks, through the router; clients that vanish), then prefix-aware routing against round-robin
(a `tokenloom serve -dp 2` fleet), then the router's replica killed under load, then an engine replica
killed under load, then one hung."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import time

import httpx
import openai
import pytest
from conftest_fleet import FleetProcess, ServeRunFleet, replica_pids, replica_totals
from conftest_server import scrape, wait_for

from tokenloom import SamplingParams
from tokenloom.engine.step_log import read_step_logs, replica_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
STALL_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def steps_file(tmp_path_factory):
    return tmp_path_factory.mktemp("steps") / "steps.jsonl"


@pytest.fixture(scope="module")
def fleet(steps_file):
    # Armed for the last test: a request marked STALLME hangs its replica's engine (others are untouched).
    os.environ["TOKENLOOM_FAULTS"] = "stall:STALLME"
    try:
        srv = ServeRunFleet(["--routing-policy", "prefix-aware", "--engine-stall-timeout", str(STALL_TIMEOUT_S),
                             "--record-steps", str(steps_file)])
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


def test_metrics_per_replica_and_summed(fleet, sdk, steps_file):
    for prompt in PROMPTS * 2:
        sdk.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=4, temperature=0)
    time.sleep(2.5)  # the replicas report every second
    per, total = replica_totals(fleet.url, "tokenloom:generation_tokens_total")
    assert len(per) == 2, per
    assert total == sum(per.values()) >= 32
    # --record-steps: each replica wrote its own steps, which the simulator's calibration reads.
    files = [replica_path(str(steps_file), str(pid)) for pid in replica_pids(fleet, "engine")]
    steps = [read_step_logs([f]) for f in files]
    assert len(files) == 2 and all(steps), files
    assert sum(f.sampled for s in steps for f, _ in s) >= total


def test_bad_requests_are_refused_not_bounced(fleet):
    with fleet.client() as http:
        too_long = http.post("/v1/completions", json={"prompt": [1] * 3000, "max_tokens": 1})
        assert too_long.status_code == 400 and "2048" in too_long.json()["error"]["message"]
        # Fits the context, not any replica's KV cache (conftest_fleet.KV_BLOCKS): the replica that gets
        # it refuses it, as a 400.
        outgrows = http.post("/v1/completions", json={"prompt": [1] * 1500, "max_tokens": 200})
        assert outgrows.status_code == 400, outgrows.text
        assert outgrows.json()["error"]["param"] == "max_tokens" and "KV" in outgrows.json()["error"]["message"]
        bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400
        assert http.post("/v1/completions", json={"prompt": "x", "model": "nope"}).status_code == 404
        assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_clients_that_vanish_are_aborted_at_their_replicas(fleet):
    """Streaming clients that drop mid-stream, and one that stops waiting for its answer: each request
    stops on its replica as an abort (it would otherwise run its 1,000 tokens to the end)."""
    aborted_before = _finished(fleet.url, "abort")

    def drop_after_two_events(i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    break  # leaving the block closes the connection mid-stream

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(drop_after_two_events, range(4)))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fleet.url}/v1/completions", timeout=1.5,
                   json={"prompt": "A long essay:", "max_tokens": 1000, "ignore_eos": True})

    def all_aborted() -> bool:
        running = replica_totals(fleet.url, "tokenloom:num_requests_running")[1]
        return running == 0 and _finished(fleet.url, "abort") - aborted_before == 5

    assert wait_for(all_aborted, timeout=30), (replica_totals(fleet.url, "tokenloom:num_requests_running"),
                                               _finished(fleet.url, "abort") - aborted_before)


SYSTEM_PROMPTS = [f"You are assistant number {s}. " + " ".join(f"rule {s}.{k}: be precise and brief." for k in range(12))
                  for s in range(8)]


def _asking(user: int) -> list[str]:
    """One prompt per system prompt, from `user`."""
    return [f"{system}\nUser {user} asks: what is {user} + {s}?" for s, system in enumerate(SYSTEM_PROMPTS)]


def _shared_prefix_workload(seed: int = 0) -> list[str]:
    """8 system prompts x 4 users, in a shuffled order (so round-robin cannot land each prefix on one
    replica by accident)."""
    prompts = [prompt for user in range(4) for prompt in _asking(user)]
    random.Random(seed).shuffle(prompts)
    return prompts


def _cache_hits(url: str, prompts: list[str], concurrency: int = 4) -> dict[str, tuple[float, float]]:
    """Per replica, its prefix-cache hits and queries (tokens) over sending `prompts`, `concurrency` at
    a time (1: in order, each routed after the one before it finished)."""
    def per_replica(name: str) -> dict[str, float]:
        return replica_totals(url, f"tokenloom:{name}")[0]

    def prompt_tokens() -> float:
        return replica_totals(url, "tokenloom:prompt_tokens_total")[1]

    def send(prompt: str) -> int:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    hits0, queries0, prompt_tokens0 = per_replica("prefix_cache_hits_total"), per_replica(
        "prefix_cache_queries_total"), prompt_tokens()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        sent = sum(pool.map(send, prompts))
    # The replicas report every second: wait for reports that count every prompt sent.
    assert wait_for(lambda: prompt_tokens() - prompt_tokens0 >= sent, 30)
    hits, queries = per_replica("prefix_cache_hits_total"), per_replica("prefix_cache_queries_total")
    return {rid: (hits[rid] - hits0.get(rid, 0.0), queries[rid] - queries0.get(rid, 0.0)) for rid in hits}


def _hit_rate(url: str, prompts: list[str]) -> float:
    """The fleet's prefix-cache hit rate (tokens) over sending `prompts` one at a time: each policy then
    routes the same sequence (4 at a time, round-robin's misses depended on which of the 4 arrived first:
    it once hit 0.61 against its 0.49 in order, within 0.1 of prefix-aware's 0.70)."""
    per_replica = _cache_hits(url, prompts, concurrency=1).values()
    return sum(hits for hits, _ in per_replica) / sum(queries for _, queries in per_replica)


def test_prefix_aware_routing_hits_the_cache_more_than_round_robin(fleet):
    prompts = _shared_prefix_workload()
    prefix_aware = _hit_rate(fleet.url, prompts)
    rr = FleetProcess(["--routing-policy", "round-robin"])
    try:
        round_robin = _hit_rate(rr.url, prompts)
    finally:
        rr.stop()
    # 8 prefixes: prefix-aware misses each once (8 of 32); round-robin once per replica it lands on
    # (15 of 32 in this order).
    assert prefix_aware > round_robin + 0.1, (prefix_aware, round_robin)


def _streamed(url: str, prompt: str, max_tokens: int, on_first_event=lambda: None) -> str:
    """How a streamed completion that must run `max_tokens` long ended, as its client sees it."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return f"http {r.status_code}"
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        on_first_event()
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}"
    if not events or events[-1] != "[DONE]":
        return "no [DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    if any("error" in p for p in payloads):
        return "error event"
    reasons = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    return "completed" if reasons == ["length"] else f"silently cut: {reasons}"


def _finished(url: str, reason: str) -> float:
    """The fleet's requests finished for `reason` ("length", "abort", ...) so far: its total line."""
    return sum(value for key, value in scrape(url).items() if key.startswith("tokenloom:request_success_total{")
               and f'finished_reason="{reason}"' in key and "replica=" not in key)


def _serves(url: str) -> bool:
    try:
        return httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_restarted_router_sends_prefixes_back_to_the_replicas_that_cache_them(fleet):
    """The router lives in the FleetIngress replica. Killed with requests in flight, each of them ends
    (completed, or with an error its client sees), none is left running on a replica, Ray Serve starts a
    new ingress, and its router, which has routed nothing yet, sends each system prompt to the replica
    that cached it, as the old router did: the replicas report what their caches hold (prefix_summary.py)."""
    _cache_hits(fleet.url, _shared_prefix_workload())  # each system prompt cached on one replica
    before = _cache_hits(fleet.url, _asking(7))
    hits, queries = (sum(column) for column in zip(*before.values(), strict=True))
    assert len(before) == 2 and hits / queries > 0.7, before  # each prompt's system part (~93%) hit
    # Two system prompts cached on the same replica (of any three, two are). Asked first after the
    # restart, a router starting blind would send them to different replicas (the second to the one
    # caching less), and one would miss.
    homes: dict[str, list[int]] = {}
    for s in range(3):
        [home] = [rid for rid, (hits, _) in _cache_hits(fleet.url, [_asking(6)[s]]).items() if hits]
        homes.setdefault(home, []).append(s)
    pair = next(systems[:2] for systems in homes.values() if len(systems) >= 2)

    [ingress] = replica_pids(fleet, "ingress")
    aborted0 = _finished(fleet.url, "abort")
    first_events: list[None] = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # Short prompts (no whole block: routed by load, 2 per replica), 400 tokens long: 2 x 26 blocks
        # beside the 4 x 9 of a replica's cached system prompts fit its 96 (conftest_fleet.KV_BLOCKS).
        futures = [pool.submit(_streamed, fleet.url, f"Count to a thousand, take {i}:", 400,
                               lambda: first_events.append(None)) for i in range(4)]
        assert wait_for(lambda: len(first_events) == 4, 120)  # all 4 under way
        os.kill(ingress, signal.SIGKILL)
        outcomes = [f.result(timeout=180) for f in futures]
    # Cut off with the process that was streaming them: a broken stream or a 5xx, never a clean end.
    ended_visibly = ("completed", "transport RemoteProtocolError", "transport ReadError", "http 500", "http 502",
                     "http 503")
    assert all(o in ended_visibly for o in outcomes), outcomes
    cut = len(outcomes) - outcomes.count("completed")
    assert cut > 0, outcomes

    assert wait_for(lambda: _serves(fleet.url), 120)  # Ray Serve restarted the ingress
    assert replica_pids(fleet, "ingress") not in ([], [ingress])

    def idle() -> bool:
        running = replica_totals(fleet.url, "tokenloom:num_requests_running")[0]
        waiting = replica_totals(fleet.url, "tokenloom:num_requests_waiting")[0]
        return len(running) == 2 and not any(running.values()) and not any(waiting.values())

    assert wait_for(idle, 60)
    # Each cut request was aborted on its replica, not left to generate its 400 tokens for nobody.
    assert _finished(fleet.url, "abort") - aborted0 == cut

    asking = _asking(8)  # the same system prompts, another user; the pair first, one by one
    after = _cache_hits(fleet.url, [asking[s] for s in pair] + [p for s, p in enumerate(asking) if s not in pair], 1)
    # Every one went to the replica caching its system prompt: the same hits as before, replica by replica.
    assert {rid: hits for rid, (hits, _) in after.items()} == {rid: hits for rid, (hits, _) in before.items()}


def test_a_killed_replica_loses_no_request_silently(fleet):
    assert wait_for(lambda: len(replica_pids(fleet, "engine")) == 2, 60), replica_pids(fleet, "engine")
    pids = replica_pids(fleet, "engine")

    def stream(i: int) -> str:
        return _streamed(fleet.url, PROMPTS[i % 4], 48)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(stream, i) for i in range(12)]
        def both_running() -> bool:
            running = replica_totals(fleet.url, "tokenloom:num_requests_running")[0]
            return len(running) == 2 and all(running.values())

        assert wait_for(both_running, 30)  # the burst was spread over both replicas
        os.kill(pids[0], signal.SIGKILL)
        outcomes = [f.result(timeout=180) for f in futures]
    assert all(o in ("completed", "error event", "http 503") for o in outcomes), outcomes
    assert "completed" in outcomes  # the other replica's requests went on

    # The endpoint keeps serving, and Ray brings the fleet back to two replicas.
    with fleet.client() as http:
        assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    assert wait_for(lambda: len(replica_pids(fleet, "engine")) == 2 and pids[0] not in replica_pids(fleet, "engine"), 120)
    assert wait_for(lambda: len(replica_totals(fleet.url, "tokenloom:generation_tokens_total")[0]) == 2, 120)


def test_a_hung_replica_is_taken_out_of_rotation_and_replaced(fleet):
    """One replica's engine hangs inside a step (an injected stall, for the request marked STALLME): the
    replica says so within --engine-stall-timeout, the router sends everything else to the other one,
    and Ray Serve's health check replaces it. (Last in the module: it leaves a replica being replaced.)"""
    assert wait_for(lambda: len(replica_pids(fleet, "engine")) == 2, 120)
    before = set(replica_pids(fleet, "engine"))
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
    assert wait_for(lambda: len(set(replica_pids(fleet, "engine")) - before) == 1, 120), replica_pids(fleet, "engine")
