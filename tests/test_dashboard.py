"""The dashboard's snapshot (engine/snapshot.py) and its routes (server/dashboard.py) on the tiny
random model: what a snapshot holds and what it costs, and the stream's bounds (auth, rate, viewer cap,
vanishing viewers, a viewer that never reads, shutdown) against a real uvicorn in this process, so
disconnects are real socket closes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from tokenloom import SamplingParams
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.metrics import EngineMetrics
from tokenloom.engine.snapshot import EngineRecorder
from tokenloom.server.app import build_app
from tokenloom.server.connection import WriteTimeoutStreamingResponse, connection_limits
from tokenloom.server.dashboard import DashboardOptions, page_html

# -- the snapshot -----------------------------------------------------------------------------------


def _run(engine, steps: int | None = None) -> None:
    n = 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        engine.step()
        n += 1


def test_snapshot_shows_batch_queues_kv_and_is_json(make_engine):
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=64, enable_chunked_prefill=True)
    rec = EngineRecorder(engine, "tiny")
    long_prompt = list(range(10, 110))  # 100 tokens: two prompt chunks under a 64-token budget
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True, priority=3))
    engine.add_request("queued", [8, 9], SamplingParams(max_tokens=2, ignore_eos=True, priority=7))
    engine.step()
    snap = rec.build()
    json.dumps(snap, allow_nan=False)  # plain JSON, as the stream sends it
    assert snap["step"]["rows"] == [{"id": "long", "tokens": 64, "kind": "prefill", "drafts": 0, "context": 64}]
    assert snap["step"]["used"] == 64 == snap["step"]["budget"]
    assert [(r["id"], r["priority"], r["prompt_tokens"]) for r in snap["waiting"]] == [("short", 3, 3), ("queued", 7, 2)]
    kv = snap["kv"]
    assert len(kv["map"]) == kv["num_blocks"] == 256
    assert kv["used"] == snap["running"][0]["blocks"] == kv["map"].count("1") == 4
    assert kv["free"] == kv["map"].count("0") == 256 - 4
    engine.step()  # the rest of "long"'s prompt and all of "short"'s (max_num_seqs 2: "queued" waits)
    snap = rec.build()
    assert [(r["id"], r["tokens"], r["kind"], r["context"]) for r in snap["step"]["rows"]] == [
        ("long", 36, "prefill", 100), ("short", 3, "prefill", 3)]
    assert [r["id"] for r in snap["running"]] == ["long", "short"] and snap["num_waiting"] == 1
    engine.step()
    rows = rec.build()["step"]["rows"]
    assert [(r["id"], r["tokens"], r["kind"]) for r in rows] == [("long", 1, "decode"), ("short", 1, "decode")]
    _run(engine)
    snap = rec.build()
    assert snap["step"]["rows"] == [] and snap["running"] == [] and snap["waiting"] == []
    assert {r["id"]: r["reason"] for r in snap["timeline"]} == {"long": "length", "short": "length", "queued": "length"}
    for r in snap["timeline"]:
        assert r["arrival"] <= r["scheduled"] <= r["first_token"] <= r["end"] <= 0
    assert snap["series"]["ttft_ms"] and sum(b[1] for b in snap["series"]["buckets"]) == 4 + 8 + 2


def test_rows_name_their_blocks_as_runs_of_ids(make_engine):
    from tokenloom.engine.snapshot import block_runs

    assert block_runs([]) == [] and block_runs([4, 5, 6, 9, 10, 2]) == [[4, 3], [9, 2], [2, 1]]
    engine = make_engine(block_size=16, max_num_seqs=2)
    rec = EngineRecorder(engine)
    engine.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("b", list(range(200, 220)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    snap = rec.build()
    owned = {r["id"]: [b for first, n in r["block_runs"] for b in range(first, first + n)] for r in snap["running"]}
    by_seq = {s.request_id: s.block_table for s in engine.scheduler.running}
    assert owned == by_seq and len(owned["a"]) == 3 and len(owned["b"]) == 2
    assert all(snap["kv"]["map"][b] == "1" for ids in owned.values() for b in ids)
    _run(engine)


def test_snapshot_kv_map_codes_cached_and_shared_blocks(make_engine):
    engine = make_engine(block_size=16)
    rec = EngineRecorder(engine)
    prefix = list(range(100, 164))  # four full blocks
    engine.add_request("a", prefix + [1], SamplingParams(max_tokens=20, ignore_eos=True))
    _run(engine, 2)
    engine.add_request("b", prefix + [2], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    kv = rec.build()["kv"]
    assert kv["shared"] == 4 and kv["map"][:4] == "3333"  # "a"'s prompt blocks, hit by "b"
    assert kv["hit_rate"] == pytest.approx(64 / (65 + 65), abs=1e-4)
    _run(engine)
    kv = rec.build()["kv"]
    assert kv["used"] == kv["shared"] == 0 and kv["cached"] >= 4  # free, still holding prefix keys
    assert kv["map"].count("2") == kv["cached"]


def test_snapshot_marks_preemption_and_abort(make_engine):
    # Six blocks of 16 tokens: two sequences growing to 48 tokens each cannot both stay.
    engine = make_engine(num_kv_blocks=6, block_size=16, max_model_len=96)
    rec = EngineRecorder(engine)
    rec.watched = True
    for rid in ("p", "q"):
        engine.add_request(rid, list(range(1, 31)), SamplingParams(max_tokens=40, ignore_eos=True))
    preempted = False
    while engine.has_unfinished_requests() and not preempted:
        engine.step()
        preempted = engine.scheduler.num_preemptions > 0
    assert preempted
    snap = rec.build()
    marks = {r["id"]: r["preempted"] for r in snap["timeline"]}
    assert sum(len(m) for m in marks.values()) == engine.scheduler.num_preemptions
    assert all(-5 < t <= 0 for m in marks.values() for t in m)
    victim = next(s for s in engine.scheduler.waiting)
    assert victim.request_id in [r["id"] for r in snap["waiting"]]
    engine.abort_request(victim.request_id)
    snap = rec.build()
    ended = {r["id"]: r["reason"] for r in snap["timeline"]}
    assert ended[victim.request_id] == "abort"
    assert victim.request_id not in [r["id"] for r in snap["waiting"] + snap["running"] + snap["step"]["rows"]]
    _run(engine)


def test_snapshot_text_only_with_the_flag(make_engine):
    engine = make_engine()
    hidden, shown = EngineRecorder(engine), EngineRecorder(engine, show_text=True)
    engine.add_request("t", "a secret prompt", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert "secret" not in json.dumps(hidden.build())
    assert shown.build()["running"][0]["prompt"] == "a secret prompt"
    _run(engine)


def test_snapshot_of_a_2000_block_pool_costs_well_under_a_millisecond(make_engine):
    engine = make_engine(num_kv_blocks=2000)
    rec = EngineRecorder(engine)
    for i in range(16):
        engine.add_request(f"r{i}", list(range(1, 200 + i)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    rec.build()
    best = min(_timed(rec.build) for _ in range(30))
    assert best < 0.001, f"a snapshot took {best * 1000:.2f} ms"
    _run(engine)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_page_assets_are_inlined_and_fetch_nothing_else():
    html = page_html()
    assert "/*__DASHBOARD" not in html and "function drawKV" in html and "--prefill" in html
    lowered = html.lower()
    for outside in ("http://", "https://", "<script src", "stylesheet", "@import", "url(", "new eventsource"):
        assert outside not in lowered, outside


# -- the routes, on a real server in this process ---------------------------------------------------


class LiveServer:
    """build_app + uvicorn on a free port, in a thread with its own event loop."""

    def __init__(self, engine, api_key: str | None = None, metrics_token: str | None = None, **options):
        metrics = EngineMetrics("tiny")
        self.async_llm = AsyncLLM(engine, metrics=metrics, num_threads=1)
        self.app = build_app(self.async_llm, "tiny", api_key, shutdown_timeout=2, metrics_token=metrics_token,
                             metrics=metrics, dashboard=DashboardOptions(**options))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", **connection_limits(30.0)))
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        self.hub = self.app.state.dashboard if options.get("enabled", True) else None

    def stats(self, **headers) -> dict:
        return httpx.get(f"{self.url}/dashboard/stats", headers=headers, timeout=10).json()

    def stop(self) -> None:
        self.app.state.tokenloom.shutting_down = True  # as on SIGTERM: open streams end, uvicorn can stop
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def live(make_engine):
    servers: list[LiveServer] = []

    def start(api_key=None, engine_kwargs=None, metrics_token=None, **options):
        server = LiveServer(make_engine(**(engine_kwargs or {})), api_key, metrics_token, **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def read_frames(url: str, count: int, headers=None, params=None, timeout: float = 30) -> list[dict]:
    frames = []
    with httpx.stream("GET", f"{url}/dashboard/stream", headers=headers, params=params, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(json.loads(line[6:]))
                if len(frames) == count:
                    break
    return frames


def error_of(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    return err


def test_stream_sends_snapshots_while_the_engine_serves(live):
    srv = live()
    done = []

    def complete():
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hello", "max_tokens": 40, "ignore_eos": True},
                       timeout=60)
        done.append(r.status_code)

    worker = threading.Thread(target=complete)
    worker.start()
    frames = read_frames(srv.url, 6, params={"rate": "10"})
    worker.join(60)
    assert done == [200]
    assert all(f["model"] == "tiny" and len(f["kv"]["map"]) == f["kv"]["num_blocks"] for f in frames)
    assert [f["server"]["viewers"] for f in frames] == [1] * 6
    steps = [f["step"]["number"] for f in frames]
    assert steps == sorted(steps)
    gaps = [b["now"] - a["now"] for a, b in itertools.pairwise(frames)]
    assert min(gaps) >= 0.08, gaps  # at most 10 a second, whatever the engine does


def test_stream_query_is_validated(live):
    srv = live()
    for query, param in [("rate=abc", "rate"), ("rate=0", "rate"), ("rate=11", "rate"), ("rate=nan", "rate"),
                         ("rate=1&rate=2", "rate"), ("token=secret", "token"), ("rate=inf", "rate")]:
        r = httpx.get(f"{srv.url}/dashboard/stream?{query}", timeout=10)
        err = error_of(r, 400, param)
        assert err["type"] == "invalid_request_error", query
    assert srv.stats()["viewers"] == 0


def test_dashboard_needs_the_api_key_and_never_in_the_url(live):
    srv = live(api_key="sekrit")
    for path in ("/dashboard", "/dashboard/stream", "/dashboard/stats"):
        err = error_of(httpx.get(srv.url + path, timeout=10), 401)
        assert err["code"] == "invalid_api_key"
        error_of(httpx.get(srv.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10), 401)
    # A browser gets the key form, still as a 401, holding no engine data.
    r = httpx.get(f"{srv.url}/dashboard", headers={"Accept": "text/html"}, timeout=10)
    assert r.status_code == 401 and "sessionStorage" in r.text and "tiny" not in r.text and "kv" not in r.text
    good = {"Authorization": "Bearer sekrit"}
    r = httpx.get(f"{srv.url}/dashboard", headers=good, timeout=10)
    assert r.status_code == 200 and "function drawKV" in r.text
    assert read_frames(srv.url, 1, headers=good)[0]["model"] == "tiny"
    # A key in the query string is not a way in (and is refused as an unknown parameter once in).
    error_of(httpx.get(f"{srv.url}/dashboard/stream?api_key=sekrit", timeout=10), 401)
    error_of(httpx.get(f"{srv.url}/dashboard/stream?api_key=sekrit", headers=good, timeout=10), 400, "api_key")


def test_disabled_dashboard_is_404(live):
    srv = live(enabled=False)
    for path in ("/dashboard", "/dashboard/stream", "/dashboard/stats"):
        error_of(httpx.get(srv.url + path, timeout=10), 404)
    listeners = srv.async_llm.engine.step_listeners
    assert not any(isinstance(getattr(fn, "__self__", None), EngineRecorder) for fn in listeners)  # no cost at all


def test_viewer_cap_is_a_clear_503(live):
    srv = live(max_viewers=2)
    with contextlib.ExitStack() as stack:
        readers = []  # each line iterator is kept: dropping one closes its connection
        for _ in range(2):
            r = stack.enter_context(httpx.stream("GET", f"{srv.url}/dashboard/stream", timeout=30))
            assert r.status_code == 200
            readers.append(r.iter_lines())
            next(readers[-1])
        assert srv.stats()["viewers"] == 2
        with httpx.stream("GET", f"{srv.url}/dashboard/stream", timeout=10) as r:  # never hangs on a 200
            r.read() if r.status_code != 200 else None
        err = error_of(r, 503)
        assert err["code"] == "too_many_viewers" and "--dashboard-max-viewers 2" in err["message"]
        assert int(r.headers["Retry-After"]) >= 1
    assert _wait(lambda: srv.stats()["viewers"] == 0)


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_fifty_vanishing_viewers_leave_no_task_or_viewer_behind(live):
    srv = live()
    assert _wait(lambda: srv.stats()["viewers"] == 0)
    base_tasks = srv.stats()["tasks"]
    for round_ in range(3):
        for _ in range(50):
            with httpx.stream("GET", f"{srv.url}/dashboard/stream", params={"rate": "10"}, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # one frame, then the viewer vanishes (the connection closes)
        assert _wait(lambda: srv.stats()["viewers"] == 0 and not srv.stats()["ticker_running"]), srv.stats()
        assert srv.stats()["tasks"] <= base_tasks, (round_, srv.stats(), base_tasks)
    assert srv.hub.snapshots >= 150
    assert srv.async_llm.engine.has_unfinished_requests() is False


def test_a_viewer_that_never_reads_does_not_stop_the_engine(live):
    srv = live()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"GET /dashboard/stream?rate=10 HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
    try:
        assert _wait(lambda: srv.stats()["viewers"] == 1)
        for _ in range(3):
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 16}, timeout=60)
            assert r.status_code == 200
        frames = read_frames(srv.url, 3, params={"rate": "10"})  # another viewer still gets frames
        assert frames[-1]["server"]["viewers"] == 2
    finally:
        sock.close()
    assert _wait(lambda: srv.stats()["viewers"] == 0)


def test_streams_end_when_the_server_shuts_down(live):
    srv = live()
    lines: list[str] = []

    def watch():
        with httpx.stream("GET", f"{srv.url}/dashboard/stream", timeout=30) as r:
            lines.extend(r.iter_lines())

    t = threading.Thread(target=watch)
    t.start()
    assert _wait(lambda: srv.stats()["viewers"] == 1)
    started = time.monotonic()
    srv.app.state.tokenloom.shutting_down = True  # as begin_shutdown does on SIGTERM
    t.join(10)
    assert not t.is_alive() and time.monotonic() - started < 5
    assert "event: end" in lines
    r = httpx.get(f"{srv.url}/dashboard/stream", timeout=10)
    assert error_of(r, 503)["code"] == "shutting_down"


def test_engine_call_runs_on_the_engine_thread(make_engine):
    async def main():
        async_llm = AsyncLLM(make_engine(), num_threads=1)
        async_llm.start()
        try:
            name = await async_llm.call_on_engine(lambda engine: threading.current_thread().name)
            with pytest.raises(ZeroDivisionError):
                await async_llm.call_on_engine(lambda engine: 1 / 0)
            assert async_llm.is_healthy  # a failing call is the caller's, not the engine's
            return name
        finally:
            await async_llm.shutdown()

    assert asyncio.run(main()) == "tokenloom-engine"


# -- recorded snapshots and their replay --------------------------------------------------------------


def _recorded(make_engine, max_frames: int, num_requests: int = 6, max_tokens: int = 20):
    from tokenloom.engine.snapshot_recording import SnapshotRecording

    engine = make_engine(max_num_seqs=2)
    recording = SnapshotRecording(engine, "continuous", max_frames)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [10 + i, 11, 12], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        recording.capture()
        recording.capture()  # no step in between: no second frame
    recording.finish()
    return engine, recording


def test_recording_keeps_live_frames_bounded_and_evenly_spaced(make_engine):
    engine, rec = _recorded(make_engine, max_frames=8)
    steps = engine.num_steps
    assert steps > 40  # 6 requests x 20 tokens, two at a time
    numbers = [f["step"]["number"] for f in rec.frames]
    assert 4 <= len(rec.frames) <= 8
    assert numbers[0] == 1 and numbers[-1] == steps  # the first and the last step are kept
    assert rec.stride >= steps // 8 and all(b - a == rec.stride for a, b in itertools.pairwise(numbers[:-1]))
    live = EngineRecorder(engine).build()
    assert set(rec.frames[-1]) == set(live)  # the live page's frame format, key for key
    assert rec.frames[-1]["step"]["rows"] == [] and len(rec.frames[-1]["timeline"]) == 6

    _, small = _recorded(make_engine, max_frames=100, num_requests=1, max_tokens=5)
    assert [f["step"]["number"] for f in small.frames] == [1, 2, 3, 4, 5] and small.stride == 1


def test_replay_file_round_trip_and_bad_files(make_engine, tmp_path):
    import gzip

    from tokenloom.engine.snapshot_recording import read_replay, write_replay

    _, rec = _recorded(make_engine, max_frames=6, num_requests=2, max_tokens=4)
    path = write_replay(str(tmp_path), [rec], {"command": "test", "model": "tiny", "plan": ""})
    assert path == str(tmp_path / "replay.json.gz")
    data = read_replay(str(tmp_path))
    assert data["runs"][0]["label"] == "continuous" and data["runs"][0]["frames"] == json.loads(json.dumps(rec.frames))
    bad = tmp_path / "bad.json.gz"
    for content, message in [(b"not gzip", "not a gzipped JSON replay"),
                             (gzip.compress(b"{\"format\": \"other\"}"), "not a tokenloom-replay file"),
                             (gzip.compress(b"{\"format\": \"tokenloom-replay\", \"version\": 9}"), "version 9"),
                             (gzip.compress(b"{\"format\": \"tokenloom-replay\", \"version\": 1, \"runs\": []}"),
                              "no run with frames")]:
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_replay(str(bad))
    with pytest.raises(ValueError, match="no file at"):
        read_replay(str(tmp_path / "missing"))


def test_replay_app_serves_the_page_in_replay_mode_and_the_file(make_engine, tmp_path):
    import gzip

    from fastapi.testclient import TestClient

    from tokenloom.engine.snapshot_recording import write_replay
    from tokenloom.server.dashboard_replay import PAGE_PATH, build_replay_app

    _, rec = _recorded(make_engine, max_frames=6, num_requests=2, max_tokens=4)
    path = write_replay(str(tmp_path), [rec], {"command": "test", "model": "tiny", "plan": ""})
    client = TestClient(build_replay_app(str(tmp_path)))
    page = client.get(PAGE_PATH)
    assert page.status_code == 200 and 'data-mode="replay"' in page.text and "replay-slider" in page.text
    assert "tokenloomDashboard" in page.text and "function drawKV" in page.text  # the live page's drawing
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    data = client.get(PAGE_PATH + "/data")
    assert data.headers["content-encoding"] == "gzip"
    assert data.json() == json.loads(gzip.decompress(Path(path).read_bytes()))
    assert client.get("/", follow_redirects=False).headers["location"] == PAGE_PATH
    for url in (PAGE_PATH + "?frame=3", PAGE_PATH + "/data?run=x"):
        error_of(client.get(url), 400, url.split("?")[1].split("=")[0])
    live = page_html()
    assert 'data-mode="live"' in live and "replay-slider" in live and "function show(" not in live  # no replay JS
    with pytest.raises(ValueError, match="no file at"):
        build_replay_app(str(tmp_path / "nowhere"))


# -- a flood of viewers ----------------------------------------------------------------------------


def test_a_flood_of_viewers_beyond_the_cap_gets_503_and_the_engine_keeps_serving(live):
    srv = live(max_viewers=3)
    assert _wait(lambda: srv.stats()["viewers"] == 0)
    base_tasks = srv.stats()["tasks"]

    async def flood() -> tuple[list[httpx.Response], list[int], int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30,
                                     limits=httpx.Limits(max_connections=None)) as client:
            holders = []
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(3):  # the cap, held open for the whole flood
                    r = await stack.enter_async_context(client.stream("GET", "/dashboard/stream"))
                    assert r.status_code == 200
                    holders.append(r.aiter_lines())
                    await anext(holders[-1])

                async def refused_viewer() -> httpx.Response:
                    async with client.stream("GET", "/dashboard/stream", params={"rate": "10"}) as r:
                        await r.aread()
                        return r

                async def completion() -> int:
                    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 12, "ignore_eos": True})
                    return r.status_code

                results = await asyncio.gather(*[refused_viewer() for _ in range(60)],
                                               *[completion() for _ in range(4)])
                viewers_during = (await client.get("/dashboard/stats")).json()["viewers"]
        return list(results[:60]), list(results[60:]), viewers_during

    refused, served, viewers_during = asyncio.run(flood())
    assert served == [200] * 4  # the engine kept serving through the flood
    assert viewers_during == 3
    for r in refused:
        err = error_of(r, 503)
        assert err["code"] == "too_many_viewers" and int(r.headers["Retry-After"]) >= 1
    assert _wait(lambda: srv.stats()["viewers"] == 0 and not srv.stats()["ticker_running"]), srv.stats()
    assert srv.stats()["tasks"] <= base_tasks
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


# -- who sees what: the dashboard obeys /metrics' rule (server/tenancy.py) ---------------------------

K, MT = {"Authorization": "Bearer K"}, {"Authorization": "Bearer MT"}
NOBODY, WRONG = {}, {"Authorization": "Bearer wrong"}


@pytest.mark.parametrize("api_key,metrics_token,expected", [
    # role -> (dashboard status, dashboard shows the prefix cache, /metrics status)
    (None, None, {"nobody": (200, True, 200), "K": (200, True, 200), "MT": (200, True, 200)}),
    ("K", None, {"nobody": (401, None, 401), "K": (200, False, 200), "MT": (401, None, 401)}),
    (None, "MT", {"nobody": (401, None, 401), "K": (401, None, 401), "MT": (200, True, 200)}),
    ("K", "MT", {"nobody": (401, None, 401), "K": (401, None, 401), "MT": (200, True, 200)}),
])
def test_each_role_sees_on_the_dashboard_what_it_sees_on_metrics(live, api_key, metrics_token, expected):
    srv = live(api_key=api_key, metrics_token=metrics_token)
    api = K if api_key else NOBODY
    prompt = " ".join(["the same long prompt"] * 30)  # several full blocks, sent twice: a prefix hit
    for _ in range(2):
        assert httpx.post(f"{srv.url}/v1/completions", headers=api, json={"prompt": prompt, "max_tokens": 2},
                          timeout=60).status_code == 200
    roles = {"nobody": NOBODY, "K": K, "MT": MT}
    for role, (status, full, metrics_status) in expected.items():
        headers = roles[role]
        assert httpx.get(f"{srv.url}/metrics", headers=headers, timeout=10).status_code == metrics_status, role
        for path in ("/dashboard", "/dashboard/stats"):
            assert httpx.get(srv.url + path, headers=headers, timeout=10).status_code == status, (role, path)
        if status != 200:
            r = httpx.get(f"{srv.url}/dashboard/stream", headers=headers, timeout=10)
            assert error_of(r, 401)["code"] == "invalid_api_key", role
            continue
        frame = read_frames(srv.url, 1, headers=headers)[0]
        kv, text = frame["kv"], json.dumps(frame)
        if full:
            assert kv["prefix_hits"] > 0 and kv["cached"] > 0 and "2" in kv["map"], role
        else:
            assert "prefix_hits" not in text and "prefix_queries" not in text and "block_runs" not in text, role
            assert kv["hit_rate"] is None and "cached" not in kv and "shared" not in kv
            assert set(kv["map"]) <= {"0", "1"} and kv["free"] == kv["map"].count("0")
            metrics_text = httpx.get(f"{srv.url}/metrics", headers=headers, timeout=10).text
            assert "prefix_cache" not in metrics_text  # the same rule on both
    assert srv.stats(**(MT if metrics_token else K if api_key else {}))["viewers"] == 0 or _wait(
        lambda: srv.stats(**(MT if metrics_token else K if api_key else {}))["viewers"] == 0)


def _frame_while_running(srv, headers, api_headers) -> dict:
    done = []

    def complete():
        r = httpx.post(f"{srv.url}/v1/completions", headers=api_headers,
                       json={"prompt": "my secret prompt", "max_tokens": 400, "ignore_eos": True}, timeout=120)
        done.append(r.status_code)

    worker = threading.Thread(target=complete)
    worker.start()
    try:
        with httpx.stream("GET", f"{srv.url}/dashboard/stream", headers=headers, params={"rate": "10"},
                          timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and (frame := json.loads(line[6:]))["running"]:
                    return frame
    finally:
        worker.join(120)
        assert done == [200]
    raise AssertionError("no frame showed the request running")


def test_text_only_for_the_metrics_token_with_the_flag(live):
    srv = live(api_key="K", metrics_token="MT", show_text=True)
    frame = _frame_while_running(srv, MT, K)
    row = frame["running"][0]
    assert "prompt" in row and "output" in row and frame["config"]["show_text"] is True
    assert frame["running"][0]["block_runs"] and frame["kv"]["prefix_queries"] > 0


def test_text_never_for_the_api_key_and_not_without_the_flag(live):
    srv = live(api_key="K")
    frame = _frame_while_running(srv, K, K)
    assert "secret" not in json.dumps(frame) and frame["config"]["show_text"] is False
    srv = live(metrics_token="MT")  # the operator, but no --dashboard-show-text
    frame = _frame_while_running(srv, MT, NOBODY)
    assert "secret" not in json.dumps(frame) and "prompt" not in frame["running"][0]
    assert frame["running"][0]["block_runs"]  # the operator's full view otherwise


def test_show_text_without_a_metrics_token_is_refused_at_start(make_engine):
    for api_key in (None, "K"):
        with pytest.raises(ValueError, match="--metrics-token"):
            build_app(AsyncLLM(make_engine(), num_threads=1), "tiny", api_key,
                      dashboard=DashboardOptions(show_text=True))


def test_redaction_leaves_the_operator_snapshot_whole(make_engine):
    from tokenloom.engine.snapshot import redacted

    engine = make_engine(block_size=16)
    rec = EngineRecorder(engine, show_text=True)
    prefix = list(range(100, 164))
    engine.add_request("a", prefix + [1], SamplingParams(max_tokens=20, ignore_eos=True))
    _run(engine, 2)
    engine.add_request("b", prefix + [2], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    snap = rec.build()
    before = json.dumps(snap)
    public = redacted(snap, prefix_cache=False, text=False)
    assert json.dumps(snap) == before  # not changed in place
    assert public["kv"]["map"].count("1") == public["kv"]["used"] == snap["kv"]["used"] + snap["kv"]["shared"]
    assert public["kv"]["free"] == snap["kv"]["free"] + snap["kv"]["cached"]
    assert all("block_runs" not in r and "prompt" not in r for r in public["running"])
    no_text = redacted(snap, prefix_cache=True, text=False)
    assert no_text["kv"] == snap["kv"] and all("prompt" not in r and r["block_runs"] for r in no_text["running"])
    assert redacted(snap, prefix_cache=True, text=True) == snap
    _run(engine)


def test_per_client_viewer_limit_with_auth_on(live):
    srv = live(api_key="K", max_viewers_per_client=2)
    with contextlib.ExitStack() as stack:
        for _ in range(2):
            r = stack.enter_context(httpx.stream("GET", f"{srv.url}/dashboard/stream", headers=K, timeout=30))
            assert r.status_code == 200
        r = httpx.get(f"{srv.url}/dashboard/stream", headers=K, timeout=10)
        err = error_of(r, 429)
        assert err["code"] == "too_many_viewers" and "Retry-After" in r.headers
    assert _wait(lambda: srv.stats(**K)["viewers"] == 0)
    with httpx.stream("GET", f"{srv.url}/dashboard/stream", headers=K, timeout=30) as r:
        assert r.status_code == 200  # the slots came back


def test_start_up_line_says_who_sees_what():
    from tokenloom.server.tenancy import MetricsAccess

    assert "anyone, in full" in MetricsAccess().describe()
    line = MetricsAccess("K", "MT").describe(show_text=True)
    assert "in full for the metrics token" in line and "nobody else" in line and "text: the metrics token" in line
    assert "for the API key" in MetricsAccess("K").describe()
    assert "anyone (/metrics only" in MetricsAccess("K", "MT", True).describe()


# -- write timeouts: a client whose socket stays full is cut off and its slot freed -------------------


def _never_reading(port: int, request: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(request)
    return sock


def test_viewers_that_never_read_are_cut_off_and_their_slots_freed(live, monkeypatch):
    """Issue 57 #8: four sockets that never read held every viewer slot for minutes."""
    from tokenloom.server import dashboard

    monkeypatch.setattr(dashboard, "SEND_TIMEOUT_S", 1.0)
    srv = live(max_viewers=4, engine_kwargs={"num_kv_blocks": 4096, "block_size": 16})  # 4 KB of map a frame
    started = time.monotonic()
    socks = [_never_reading(srv.port, b"GET /dashboard/stream?rate=10 HTTP/1.1\r\nHost: x\r\n\r\n")
             for _ in range(4)]
    try:
        assert _wait(lambda: srv.stats()["viewers"] == 4)
        assert httpx.get(f"{srv.url}/dashboard/stream", timeout=10).status_code == 503  # all slots held
        assert _wait(lambda: srv.stats()["viewers_cut_off"] == 4, timeout=60), srv.stats()
        held_for = time.monotonic() - started
        assert _wait(lambda: srv.stats()["viewers"] == 0)
        assert read_frames(srv.url, 1)[0]["server"]["viewers"] == 1  # a slot is free again
    finally:
        for sock in socks:
            sock.close()
    print(f"4 non-reading viewers cut off {held_for:.1f} s after they connected (write timeout 1 s)")
    assert held_for < 60


def test_an_sse_client_that_never_reads_is_cut_off_and_its_request_aborted(live, monkeypatch):
    monkeypatch.setattr(WriteTimeoutStreamingResponse, "write_timeout_s", 1.0)
    srv = live()
    before = WriteTimeoutStreamingResponse.cut_off
    body = json.dumps({"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "logprobs": 20, "stream": True})
    sock = _never_reading(srv.port, (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                     f"\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    started = time.monotonic()
    try:
        engine = srv.async_llm.engine
        assert _wait(lambda: WriteTimeoutStreamingResponse.cut_off > before, timeout=60)
        assert _wait(lambda: not engine.has_unfinished_requests())  # aborted, its blocks freed
        generated = srv.async_llm.engine.num_steps
        assert generated < 1000, "the request ran to its end instead of being cut off"
    finally:
        sock.close()
    print(f"a non-reading SSE client cut off {time.monotonic() - started:.1f} s after it asked (timeout 1 s)")
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200  # the server serves on


def test_a_reading_sse_client_is_never_cut_off(live, monkeypatch):
    monkeypatch.setattr(WriteTimeoutStreamingResponse, "write_timeout_s", 1.0)
    srv = live()
    before = WriteTimeoutStreamingResponse.cut_off
    with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                      json={"prompt": "hi", "max_tokens": 300, "ignore_eos": True, "logprobs": 20, "stream": True}) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    last = json.loads(chunks[-1][6:])["choices"][0]
    assert last["finish_reason"] == "length" and WriteTimeoutStreamingResponse.cut_off == before
