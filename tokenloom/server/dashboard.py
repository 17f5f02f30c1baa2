"""The live dashboard: `GET /dashboard` (one page) and `GET /dashboard/stream` (server-sent events of
engine snapshots, engine/snapshot.py), plus `GET /dashboard/stats` (viewer and task counts).

Cost and bounds:
- Snapshots are built on the engine thread between two steps (`AsyncLLM.call_on_engine`) by one ticker
  task, and only while a viewer is connected, at most MAX_RATE_HZ times a second. Each snapshot is
  encoded once and handed to every viewer.
- A viewer holds one frame: the newest. A viewer that falls behind loses the frames it did not take
  (counted as dropped); nothing queues. A viewer whose socket accepts nothing for SEND_TIMEOUT_S is cut
  off, so one that never reads holds no more than the socket's buffers, and not for long.
- At most `max_viewers` streams at once; beyond that 503 + Retry-After. A viewer that goes away is
  noticed through the ASGI disconnect message at once, and its slot and task go with it.

Auth: the dashboard shows engine state, so it obeys /metrics' rule (server/tenancy.py MetricsAccess):
with `--metrics-token` only that token opens it (even without `--api-key`) and sees everything; with
only `--api-key` the key opens it without the prefix-cache counters, the block map's cached / shared
marks and each request's block ids; prompt and output text (`--dashboard-show-text`) go to the
metrics token only. With auth on, one client (address) holds at most `max_viewers_per_client`
streams. A token never goes in a URL (which would land in access logs and browser history). A browser opening
/dashboard without it gets a 401 whose body is a small form (static/dashboard_login.html): it keeps the
key in sessionStorage, fetches the page with the header and shows it; the page reads the stream with
`fetch()` and the same header (EventSource cannot send one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from ..engine.async_llm import AsyncLLM
from ..engine.snapshot import EngineRecorder, redacted
from .connection import WRITE_TIMEOUT_S
from .errors import APIError
from .tenancy import MetricsAccess

logger = logging.getLogger("tokenloom.dashboard")

DEFAULT_MAX_VIEWERS = 16
DEFAULT_MAX_VIEWERS_PER_CLIENT = 4  # with auth on: streams one client address may hold
MAX_RATE_HZ = 10.0
MIN_RATE_HZ = 0.2
DEFAULT_RATE_HZ = 5.0
SEND_TIMEOUT_S = WRITE_TIMEOUT_S  # a viewer whose socket takes longer than this to take one frame is cut off
BUILD_TIMEOUT_S = 30.0  # a snapshot waits for the step in progress; a step this long is an engine in trouble
KEEPALIVE_S = 15.0  # an SSE comment when no frame went out for this long (proxies close idle streams)
STOP_CHECK_S = 1.0  # how often a waiting stream looks whether the server is shutting down
RETRY_AFTER_S = 5
WAKE_EARLY_S = 0.5 / MAX_RATE_HZ  # a viewer wakes this long before its next frame is due (see SnapshotStream)
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-store"),
                (b"x-accel-buffering", b"no")]
# The page and its login form are self-contained (inline CSS and JS, nothing fetched but the stream).
PAGE_HEADERS = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
                 "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                 "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                 "form-action 'none'; frame-ancestors 'none'"}


@dataclass
class DashboardOptions:
    enabled: bool = True
    max_viewers: int = DEFAULT_MAX_VIEWERS
    show_text: bool = False  # prompts and outputs in snapshots (--dashboard-show-text), for the metrics token
    max_viewers_per_client: int = DEFAULT_MAX_VIEWERS_PER_CLIENT
    # A multi-model server's view of every model and cascade (multi_serve.overview), in each frame.
    overview: Callable[[], dict] | None = None


@dataclass(eq=False)
class Viewer:
    interval: float  # seconds between this viewer's frames (its `rate`)
    view: tuple[bool, bool] = (False, False)  # (prefix-cache state, text) this viewer may see
    client: str = ""
    frame: bytes | None = None  # the newest frame not yet sent: one slot, overwritten
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    gone: bool = False
    sent: int = 0
    dropped: int = 0


class DashboardHub:
    """The viewers, and the one task that builds snapshots for them."""

    def __init__(self, async_llm: AsyncLLM, recorder: EngineRecorder, max_viewers: int = DEFAULT_MAX_VIEWERS,
                 max_viewers_per_client: int | None = None, overview: Callable[[], dict] | None = None):
        self.async_llm = async_llm
        self.overview = overview
        self.recorder = recorder
        self.max_viewers = max_viewers
        self.max_viewers_per_client = max_viewers_per_client  # None: no per-client bound (auth off)
        self.viewers: set[Viewer] = set()
        self._ticker: asyncio.Task | None = None
        self.snapshots = 0
        self.frames_dropped = 0
        self.viewers_cut_off = 0  # stalled viewers dropped after SEND_TIMEOUT_S
        self.build_seconds = 0.0  # engine-thread time spent building snapshots (what the engine pays)

    def join(self, rate: float, view: tuple[bool, bool] = (True, False), client: str = "") -> Viewer:
        if len(self.viewers) >= self.max_viewers:
            raise APIError(503, f"the dashboard has {len(self.viewers)} viewers, the most it takes "
                           f"(--dashboard-max-viewers {self.max_viewers}); retry later", "server_error",
                           code="too_many_viewers", headers={"Retry-After": str(RETRY_AFTER_S)})
        per_client = self.max_viewers_per_client
        if per_client is not None and sum(v.client == client for v in self.viewers) >= per_client:
            raise APIError(429, f"this client holds {per_client} dashboard streams, the most one client may "
                           f"(--dashboard-max-viewers-per-client); close one first", "rate_limit_error",
                           code="too_many_viewers", headers={"Retry-After": str(RETRY_AFTER_S)})
        viewer = Viewer(interval=1.0 / rate, view=view, client=client)
        self.viewers.add(viewer)
        self.recorder.watched = True
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="tokenloom-dashboard")
        return viewer

    def leave(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)
        if not self.viewers:
            self.recorder.watched = False  # the ticker sees no viewer and ends

    def stats(self) -> dict:
        return {"viewers": len(self.viewers), "max_viewers": self.max_viewers,
                "ticker_running": self._ticker is not None and not self._ticker.done(),
                "tasks": len(asyncio.all_tasks()), "snapshots": self.snapshots,
                "frames_dropped": self.frames_dropped, "viewers_cut_off": self.viewers_cut_off,
                "build_ms_total": round(self.build_seconds * 1000, 3)}

    def _build(self, engine) -> tuple[dict, float]:
        started = time.perf_counter()
        snap = self.recorder.build(engine)
        return snap, time.perf_counter() - started

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while self.viewers:
            started = loop.time()
            try:
                snap, cost = await asyncio.wait_for(self.async_llm.call_on_engine(self._build), BUILD_TIMEOUT_S)
                self.build_seconds += cost
            except Exception as exc:  # noqa: BLE001 - a dead or stuck engine is shown, not raised
                snap = {"error": f"no snapshot: {exc!r}"}
            self.snapshots += 1
            snap["server"] = self.stats()
            if self.overview is not None:
                try:
                    snap["overview"] = self.overview()
                except Exception as exc:  # noqa: BLE001 - shown, like a snapshot that failed: the ticker goes on
                    snap["overview_error"] = f"no overview: {exc!r}"
            frames: dict[tuple[bool, bool], bytes] = {}  # each view encoded once, for all its viewers
            for viewer in self.viewers:
                if (frame := frames.get(viewer.view)) is None:
                    shown = redacted(snap, prefix_cache=viewer.view[0], text=viewer.view[1])
                    frame = frames[viewer.view] = (b"data: " + json.dumps(shown, separators=(",", ":"),
                                                                          allow_nan=False).encode() + b"\n\n")
                if viewer.frame is not None:
                    viewer.dropped += 1
                    self.frames_dropped += 1
                viewer.frame = frame
                viewer.wake.set()
            if not self.viewers:
                break
            interval = max(min(v.interval for v in self.viewers), 1.0 / MAX_RATE_HZ)
            await asyncio.sleep(max(interval - (loop.time() - started), 0.0))


class SnapshotStream(Response):
    """The SSE response of one viewer (pure ASGI: it watches for the disconnect itself and bounds
    each write, which StreamingResponse does not)."""

    def __init__(self, hub: DashboardHub, viewer: Viewer, stopping):
        self.hub, self.viewer, self.stopping = hub, viewer, stopping
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        viewer = self.viewer
        watcher = asyncio.create_task(self._watch_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            # `retry`: how long a browser EventSource would wait to reconnect; the page does the same.
            if not await self._write(send, b"retry: 2000\n\n"):
                return
            last_write = due = asyncio.get_running_loop().time()
            while not viewer.gone:
                if self.stopping():
                    await self._write(send, b"event: end\ndata: {\"reason\":\"shutting down\"}\n\n", more=False)
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STOP_CHECK_S):
                        await viewer.wake.wait()
                viewer.wake.clear()
                now = asyncio.get_running_loop().time()
                frame, viewer.frame = viewer.frame, None
                if frame is None:
                    if now - last_write < KEEPALIVE_S:
                        continue
                    frame = b": keep-alive\n\n"
                if viewer.gone or not await self._write(send, frame):
                    return
                viewer.sent += 1
                last_write = now
                # This viewer's own rate: frames built meanwhile wait in its slot (only the newest). Its
                # frames are due on a fixed beat, so its average rate is its own, and it wakes half a
                # ticker period early: frames come on the ticker's beat, and a viewer at the ticker's
                # rate that slept its whole interval would wake just after a frame and lose it to the
                # next one (measured: 6 of 10 frames a second reached such viewers).
                due = max(due + viewer.interval, now)
                await asyncio.sleep(max(due - WAKE_EARLY_S - asyncio.get_running_loop().time(), 0.0))
        finally:
            watcher.cancel()
            self.hub.leave(viewer)

    async def _watch_disconnect(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.viewer.gone = True
        self.viewer.wake.set()

    async def _write(self, send, data: bytes, more: bool = True) -> bool:
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await send({"type": "http.response.body", "body": data, "more_body": more})
            return True
        except TimeoutError:
            self.viewer.gone = True
            self.hub.viewers_cut_off += 1
            logger.warning("dashboard: a viewer took no data for %.0fs; its stream is closed", SEND_TIMEOUT_S)
            return False
        except OSError:  # the connection went away mid-write
            self.viewer.gone = True
            return False


def parse_stream_query(params) -> float:
    """The stream's query: `rate` (frames per second, MIN_RATE_HZ..MAX_RATE_HZ) and, from a multi-model
    server's page, the `model` its front routed by; nothing else."""
    for name in params:
        if name not in ("rate", "model"):
            raise APIError(400, f"{name}: unknown parameter; /dashboard/stream takes only 'rate' and 'model'",
                           param=name)
    values = params.getlist("rate")
    if not values:
        return DEFAULT_RATE_HZ
    if len(values) > 1:
        raise APIError(400, "rate: given more than once", param="rate")
    try:
        rate = float(values[0])
    except ValueError:
        rate = math.nan
    if not MIN_RATE_HZ <= rate <= MAX_RATE_HZ:  # NaN fails both
        raise APIError(400, f"rate: must be a number of frames per second in [{MIN_RATE_HZ}, {MAX_RATE_HZ}], "
                       f"got {values[0][:40]!r}", param="rate")
    return rate


def _static(name: str) -> str:
    return resources.files("tokenloom.server").joinpath("static", name).read_text("utf-8")


def page_html(replay: bool = False) -> str:
    """The page with its CSS and JS inlined: a browser sends no key with <script src>, so the page
    must arrive whole with the one request that carries it. The files stay separate in the package.
    `replay`: the same page in replay mode (`server/dashboard_replay.py`): no stream, recorded frames
    drawn by the same code, with a step control."""
    css, js = _static("dashboard.css"), _static("dashboard.js")
    replay_js = _static("dashboard_replay.js") if replay else ""
    if "</script" in (js + replay_js).lower() or "</style" in css.lower():
        raise RuntimeError("dashboard assets must not close their own inline element")
    html = _static("dashboard.html")
    if replay:
        html = html.replace('<body data-mode="live">', '<body data-mode="replay">')
    return (html.replace("/*__DASHBOARD_CSS__*/", css).replace("/*__DASHBOARD_JS__*/", js)
            .replace("/*__REPLAY_JS__*/", replay_js))


def add_dashboard_routes(app: FastAPI, state, access: MetricsAccess, options: DashboardOptions) -> DashboardHub:
    """`access`: /metrics' rule, which the dashboard obeys (server/tenancy.py)."""
    async_llm = state.async_llm
    if options.show_text and access.metrics_token is None:
        raise ValueError("--dashboard-show-text: prompt and output text go only to the holder of --metrics-token; "
                         "set one")
    recorder = EngineRecorder(async_llm.engine, state.model_name, options.show_text)
    auth_on = access.api_key is not None or access.metrics_token is not None
    hub = DashboardHub(async_llm, recorder, options.max_viewers,
                       options.max_viewers_per_client if auth_on else None, options.overview)
    app.state.dashboard = hub
    page, login = page_html(), _static("dashboard_login.html")

    def view_of(request: Request) -> tuple[bool, bool] | None:
        given = request.headers.get("authorization", "").encode("latin-1", "replace")
        view = access.view(given, scrape=False)
        if view is None:
            return None
        return view == "full", options.show_text and access.operator_token(given)

    def refused(request: Request) -> APIError | None:
        return None if view_of(request) is not None else access.refusal("the dashboard")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page(request: Request):
        if (error := refused(request)) is not None:
            if "text/html" in request.headers.get("accept", ""):  # a browser: the key form, still a 401
                return HTMLResponse(login, 401, headers={**PAGE_HEADERS, "WWW-Authenticate": "Bearer"})
            return error.response()
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get("/dashboard/stream", include_in_schema=False)
    async def dashboard_stream(request: Request):
        if (error := refused(request)) is not None:
            return error.response()
        rate = parse_stream_query(request.query_params)
        if state.shutting_down:
            return APIError(503, "the server is shutting down", "server_error", code="shutting_down").response()
        client = request.client.host if request.client is not None else ""
        return SnapshotStream(hub, hub.join(rate, view_of(request), client), lambda: state.shutting_down)

    @app.get("/dashboard/stats", include_in_schema=False)
    async def dashboard_stats(request: Request):
        if (error := refused(request)) is not None:
            return error.response()
        return JSONResponse(hub.stats())

    return hub
