"""The dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright for
Python) against a real `tokenloom serve` of the bundled SmolLM2 under load from concurrent requests.

One server for the whole module (never two at once on a shared machine), with an API key (so every
test also goes through the key form) and a KV cache of 24 blocks of 16 tokens: a few concurrent
requests of ~170 tokens each cannot all keep their blocks, so the scheduler preempts.

The views are read from the data-* attributes each view writes as it draws (what the page drew, not
what the server sent). Run with TOKENLOOM_DASHBOARD_SCREENSHOT=docs/dashboard.png to save the
screenshot of the page under load that the README shows.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
from conftest_server import ServerProcess, wait_for

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "dash-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_ARGS = ["--num-kv-blocks", "24", "--block-size", "16", "--max-model-len", "384", "--max-num-seqs", "8",
               "--dashboard-max-viewers", "64"]
PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details about the weather."


@pytest.fixture(scope="module")
def browser():
    # A missing browser is a failure that says what to do, never a silent skip.
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: the dashboard's browser tests need Debian's chromium. Install it with "
                    "`apt-get install chromium` (as root; `make install` does it), not `playwright install`.")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: `pip install playwright` (in the test extras: `make install`)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(SERVER_ARGS, api_key=KEY)
    yield srv
    srv.stop()


class Dashboard:
    """One browser tab on /dashboard, logged in through the key form."""

    def __init__(self, browser, server, key: str = KEY, path: str = "/dashboard"):
        self.context = browser.new_context(viewport={"width": 1440, "height": 1100})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.urls.append(r.url))
        response = self.page.goto(f"{server.url}{path}")
        assert response.status == 401  # no key yet: the form, not the page
        self.page.fill("#key", key)
        self.page.click("button[type=submit]")

    def wait_live(self) -> None:
        self.page.wait_for_selector("#status.live", timeout=60_000)
        # The only console errors so far: Chromium's notice of the 401 that served the key form.
        assert all("401" in e for e in self.errors), self.errors
        self.errors.clear()

    def data(self, selector: str) -> dict:
        return self.page.eval_on_selector(selector, "el => Object.assign({}, el.dataset)")

    def ids(self, selector: str) -> list[str]:
        value = self.data(selector).get("ids", "")
        return value.split(",") if value else []

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def dashboard(browser, server):
    tabs: list[Dashboard] = []

    def open_tab(**kwargs) -> Dashboard:
        tab = Dashboard(browser, server, **kwargs)
        tabs.append(tab)
        return tab

    yield open_tab
    for tab in tabs:
        tab.close()


def stream_completion(url: str, body: dict, ids: list, stop: threading.Event | None = None,
                      chunks_before_close: int | None = None) -> None:
    """A streaming completion; with `chunks_before_close`, the client closes the connection after that
    many chunks (or when `stop` is set): an abort by its client."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=300) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if n == 0:
                ids.append(json.loads(line[6:])["id"])
            n += 1
            if chunks_before_close is not None and (n >= chunks_before_close or (stop and stop.is_set())):
                return  # leaving the block closes the connection mid-stream


def test_page_follows_the_engine_under_load(dashboard, server):
    tab = dashboard()
    tab.wait_live()
    assert tab.page.inner_text("#model") == "SmolLM2-135M-Instruct"
    assert tab.page.inner_text("#plan").startswith("forward plan:")
    assert tab.ids("#batch") == [] and tab.data("#kv")["used"] == "0"  # idle before the load
    start_step = int(tab.page.eval_on_selector("body", "b => b.dataset.step"))

    ids: list[str] = []
    body = {"prompt": PROMPT, "max_tokens": 150, "ignore_eos": True, "temperature": 0}
    workers = [threading.Thread(target=stream_completion, args=(server.url, body, ids)) for _ in range(5)]
    for w in workers:
        w.start()
        time.sleep(0.3)
    seen_batches, seen_used, shot, started = set(), set(), False, time.monotonic()
    most_rows = 0
    while any(w.is_alive() for w in workers):
        batch = tab.ids("#batch")
        seen_batches.add(tuple(batch))
        seen_used.add(int(tab.data("#kv")["used"]))
        most_rows = max(most_rows, len(batch))
        # The README's picture: a busy batch, after the first preemption when there is one by then.
        if (not shot and len(batch) >= 3 and os.environ.get("TOKENLOOM_DASHBOARD_SCREENSHOT")
                and (int(tab.data("#timeline")["preemptions"]) or time.monotonic() - started > 8)):
            tab.page.screenshot(path=os.environ["TOKENLOOM_DASHBOARD_SCREENSHOT"], full_page=True)
            shot = True
        time.sleep(0.25)
    for w in workers:
        w.join()
    assert len(ids) == 5
    assert most_rows >= 2, seen_batches  # several requests batched together, as drawn
    assert set().union(*map(set, seen_batches)) <= set(ids) | {""}
    assert set(ids) <= set().union(*map(set, seen_batches)) | set(tab.ids("#timeline"))
    assert len(seen_batches) >= 3 and len(seen_used) >= 3  # the views moved as requests came and went
    # Once everything finished: nothing in the batch, no block in use, every request on the timeline.
    assert wait_for(lambda: tab.ids("#batch") == [] and tab.data("#kv")["used"] == "0", 10), tab.data("#kv")
    assert set(ids) <= set(tab.ids("#timeline"))
    assert tab.data("#timeline")["live"] == ""
    # 24 blocks for 5 requests of ~170 tokens: the scheduler preempted, and the page marked it.
    assert int(tab.data("#timeline")["preemptions"]) >= 1
    assert "preemptions" in tab.page.inner_text("#summary")
    assert int(tab.data("#throughput")["points"]) > 0 and int(tab.data("#ttft")["points"]) >= 5
    assert int(tab.page.eval_on_selector("body", "b => b.dataset.step")) > start_step
    assert tab.errors == []


def test_a_request_aborted_by_its_client_leaves_the_view(dashboard, server):
    tab = dashboard()
    tab.wait_live()
    ids: list[str] = []
    stop = threading.Event()
    body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
    t = threading.Thread(target=stream_completion, args=(server.url, body, ids, stop, 10_000))
    t.start()
    assert wait_for(lambda: ids and ids[0] in tab.ids("#batch"), 60), (ids, tab.ids("#batch"))
    rid = ids[0]
    assert rid in tab.ids("#running")
    stop.set()  # the client closes its connection at its next chunk
    t.join(60)
    assert wait_for(lambda: rid not in tab.ids("#batch") and rid not in tab.ids("#running"), 10)
    assert tab.data("#kv")["used"] == "0"
    assert rid in tab.ids("#timeline") and rid not in tab.data("#timeline")["live"].split(",")
    assert int(tab.data("#timeline")["aborted"]) >= 1
    assert tab.errors == []


def test_the_key_is_needed_and_stays_out_of_urls(dashboard, server):
    for path in ("/dashboard", "/dashboard/stream", "/dashboard/stats"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/dashboard", headers=AUTH, timeout=10).status_code == 200
    r = httpx.get(f"{server.url}/dashboard/stream?rate=fast", headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rate"

    wrong = dashboard(key="not-the-key")
    wrong.page.wait_for_function("document.getElementById('message').textContent.length > 0")
    assert "refused" in wrong.page.inner_text("#message")
    assert wrong.page.query_selector("#kv") is None  # no page without the key

    tab = dashboard()
    tab.wait_live()
    tab.page.reload()  # the key is kept for the tab: a reload goes straight back to the page
    tab.page.wait_for_selector("#status.live", timeout=60_000)
    for url in tab.urls + wrong.urls:
        assert KEY not in url and "not-the-key" not in url, url


def test_a_multi_model_server_shows_every_model_and_cascade(browser):
    from tokenloom.model.loader import bundled_model_path

    model = bundled_model_path()
    srv = ServerProcess([f"a={model}", f"b={model}", "--cascade", "both=a,b", "--max-model-len", "384"], api_key=KEY)
    try:
        tab = Dashboard(browser, srv, path="/dashboard?model=b")
        try:
            tab.wait_live()
            assert tab.page.inner_text("#model") == "b"
            tab.page.wait_for_selector("#models-panel:not([hidden]) #models tr[data-name=a]", timeout=30_000)
            rows = tab.page.eval_on_selector_all("#models tbody tr", "trs => trs.map(t => [t.dataset.name, "
                                                 "t.dataset.status, t.className])")
            assert rows == [["a", "loaded", ""], ["b", "loaded", "selected"]]
            r = httpx.post(f"{srv.url}/v1/completions", headers=AUTH, timeout=120,
                           json={"model": "both", "prompt": "The capital of France is", "max_tokens": 8})
            assert r.status_code == 200, r.text
            # A frame may have been built while the request ran (counted, not yet answered): wait for its answer.
            answered = f"{r.json()['served_by']} 1"
            cell = "#cascades tr[data-name=both][data-requests='1'] td:nth-child(4)"
            tab.page.wait_for_function("([sel, want]) => document.querySelector(sel)?.textContent === want",
                                       arg=[cell, answered], timeout=30_000)
            # a viewer is no request in flight: it keeps no model from eviction or sleep
            listed = httpx.get(f"{srv.url}/v1/models", headers=AUTH, timeout=10).json()["data"]
            assert {m["id"]: m["requests_in_flight"] for m in listed if "cascade" not in m} == {"a": 0, "b": 0}
            tab.page.click("#models tr[data-name=a] a")  # a resident model's name opens its own page
            tab.page.wait_for_function("document.getElementById('model').textContent === 'a'", timeout=60_000)
            assert all("401" in e for e in tab.errors), tab.errors  # only the new page's key form
        finally:
            tab.close()
    finally:
        srv.stop()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_fifty_viewers_coming_and_going_leave_nothing_behind(server):
    def stats() -> dict:
        return httpx.get(f"{server.url}/dashboard/stats", headers=AUTH, timeout=10).json()

    assert wait_for(lambda: stats()["viewers"] == 0, 10)
    base = stats()["tasks"]
    rss = []
    for _ in range(4):
        for _ in range(50):
            with httpx.stream("GET", f"{server.url}/dashboard/stream", params={"rate": "10"}, headers=AUTH,
                              timeout=30) as r:
                assert r.status_code == 200
                next(line for line in r.iter_lines() if line.startswith("data: "))
        assert wait_for(lambda: stats()["viewers"] == 0 and not stats()["ticker_running"], 10), stats()
        assert stats()["tasks"] <= base, (stats(), base)
        rss.append(_rss_kib(server.proc.pid))
    # The first round may warm allocator arenas; after it, 50 more viewers must not grow the process.
    assert rss[-1] - rss[1] < 8 * 1024, f"RSS per round (KiB): {rss}"
    with server.client() as c:  # and the engine still serves
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200


# -- replay of a recorded lab run --------------------------------------------------------------------


@pytest.fixture
def replay_server(tiny_model, tokenizer, tmp_path):
    """`tokenloom dashboard-replay`'s app over a small lab recording (the tiny random model, three modes),
    on a free port in this process."""
    import socket

    import uvicorn

    from tokenloom.bench.workload import make_workload
    from tokenloom.engine.snapshot_recording import write_replay
    from tokenloom.lab import LabRun, run_workloads
    from tokenloom.server.dashboard_replay import build_replay_app

    reqs = make_workload("mixed", 6, seed=0, output_lens=(3, 12))
    runs = [LabRun(mode, 2, max_wait_ms=5.0) for mode in ("static", "dynamic", "continuous")]
    results = run_workloads(tiny_model, tokenizer, reqs, runs, max_frames=10, max_model_len=1024, num_kv_blocks=64)
    write_replay(str(tmp_path), [r.snapshots for r in results], {"command": "tokenloom lab (test)", "model": "tiny",
                                                                 "plan": tiny_model.plan.line()})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_replay_app(str(tmp_path)), host="127.0.0.1", port=port,
                                           log_level="warning"))
    server.install_signal_handlers = lambda: None  # not the main thread
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started, 30), "replay server did not start"
    yield f"http://127.0.0.1:{port}", results
    server.should_exit = True
    thread.join(30)


def test_replay_steps_through_the_lab_runs(browser, replay_server):
    url, results = replay_server
    context = browser.new_context(viewport={"width": 1440, "height": 1100})
    page = context.new_page()
    errors, urls = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.on("request", lambda r: urls.append(r.url))
    try:
        assert page.goto(f"{url}/dashboard/replay").status == 200
        page.wait_for_selector("#status.live", timeout=30_000)
        assert page.inner_text("#status") == "replay" and page.is_visible("#replay")

        def body() -> dict:
            return page.eval_on_selector("body", "b => Object.assign({}, b.dataset)")

        def strip() -> list[list[str]]:
            return page.eval_on_selector_all("#replay-strip tbody tr",
                                             "rows => rows.map(r => Array.from(r.cells, c => c.textContent))")

        assert body()["replayRun"] == "static" and body()["replayFrame"] == "0" and body()["step"] == "1"
        assert page.inner_text("#model") == "tiny" and page.inner_text("#plan").startswith("forward plan:")
        assert [row[0] for row in strip()] == ["static", "dynamic", "continuous"]  # side by side
        first_batch = page.eval_on_selector("#batch", "el => el.dataset.ids")

        page.click("#replay-forward")
        assert body()["replayFrame"] == "1" and int(body()["step"]) > 1
        # The KV map by request: a running request picked in its table has its blocks outlined.
        row = page.eval_on_selector("#running tbody tr", "tr => [tr.dataset.id, tr.cells[4].textContent]")
        page.click("#running tbody tr")
        kv = page.eval_on_selector("#kv", "el => Object.assign({}, el.dataset)")
        assert kv["selected"] == row[0] and kv["selectedBlocks"] == row[1] != "0"
        assert page.eval_on_selector("#running tbody tr.selected", "tr => tr.dataset.id") == row[0]
        page.click("#running tbody tr.selected")  # again: cleared
        assert page.eval_on_selector("#kv", "el => el.dataset.selected") == ""
        page.keyboard.press("ArrowRight")
        assert body()["replayFrame"] == "2"
        step_at_2 = body()["step"]
        page.click("#replay-back")
        assert body()["replayFrame"] == "1" and body()["step"] != step_at_2
        page.click("#replay-first")
        assert body()["replayFrame"] == "0" and page.eval_on_selector("#batch", "el => el.dataset.ids") == first_batch

        # The slider's end is the run's last step: everything finished, nothing in the batch.
        page.eval_on_selector("#replay-slider", "s => { s.value = s.max; s.dispatchEvent(new Event('input')); }")
        static = results[0]
        assert body()["step"] == str(len(static.steps)) and page.eval_on_selector("#batch", "el => el.dataset.ids") == ""
        assert "done" in strip()[0][-1]

        # Another run at the same engine time (each run's own clock): its last frame at or before that time.
        t = static.snapshots.frames[-1]["now"]
        continuous = results[2].snapshots.frames
        expected = [f for f in continuous if f["now"] <= t] or continuous[:1]
        page.click("#replay-runs button:has-text('continuous')")
        assert body()["replayRun"] == "continuous"
        assert int(body()["step"]) == expected[-1]["step"]["number"]
        page.click("#replay-play")
        page.click("#replay-first")  # stops playing, back to the start
        assert body()["replayFrame"] == "0"
        assert errors == [], errors
        assert all(u.startswith(url) for u in urls), urls  # nothing fetched from anywhere else
    finally:
        context.close()
