"""The app behind `tokenloom dashboard-replay PATH` (replay_cli.py): the dashboard page over a recorded
replay instead of a live engine.

PATH is a lab output directory (its replay.json.gz) or a replay file (`tokenloom simulate
--record-replay FILE`). The file is checked once at start (`read_replay`: a bad one is a one-line error
before anything listens) and then served as it is stored, gzipped, with `Content-Encoding: gzip`: the
browser unpacks it, the server never holds more than the file's bytes.

Routes (no engine, no key: it shows a file the operator chose, on 127.0.0.1 unless --host says otherwise):
- `GET /dashboard/replay`: the live page in replay mode (same drawing code, same CSP, a step control);
- `GET /dashboard/replay/data`: the recording;
- `GET /`: a redirect to the page.
Neither takes a parameter; any query is a 400 naming it.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ..engine.snapshot_recording import read_replay, resolve_replay_path
from .dashboard import PAGE_HEADERS, page_html
from .errors import APIError

PAGE_PATH = "/dashboard/replay"

logger = logging.getLogger("tokenloom.dashboard")


def build_replay_app(path: str) -> FastAPI:
    """The replay app for the recording at `path` (a file or a directory holding replay.json.gz)."""
    path = resolve_replay_path(path)
    data = read_replay(path)  # a ValueError naming the problem, before anything is served
    with open(path, "rb") as f:
        body = f.read()
    page = page_html(replay=True)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.replay_runs = [(r.get("label"), len(r["frames"])) for r in data["runs"]]

    def refused(request: Request) -> Response | None:
        for name in request.query_params:
            return APIError(400, f"{name}: unknown parameter; {request.url.path} takes none", param=name).response()
        return None

    @app.get("/", include_in_schema=False)
    async def root():
        return RedirectResponse(PAGE_PATH)

    @app.get(PAGE_PATH, include_in_schema=False)
    async def replay_page(request: Request):
        return refused(request) or HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get(PAGE_PATH + "/data", include_in_schema=False)
    async def replay_data(request: Request):
        return refused(request) or Response(body, media_type="application/json", headers={
            "Content-Encoding": "gzip", "Cache-Control": "no-store"})

    return app
