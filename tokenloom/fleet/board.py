"""The fleet's notice board: each engine replica posts its load, health and metrics every second; the
ingress reads them all back every second.

A Serve deployment of one replica (app.py), so Ray Serve owns its life with the application's. The
ingress keeps the last read in `LATEST`, a process-local table that its request router (ray_router.py,
running in the same process) ranks replicas by and that /health and /metrics read. A replica that
stops posting (its event loop frozen, or dead) reads as unhealthy after `STALE_S`, with no load or
metrics, and drops off the board after `FORGET_S` (Ray Serve will have replaced it by then).
"""

from __future__ import annotations

import logging
import time

REPORT_PERIOD_S = 1.0
STALE_S = 5.0
FORGET_S = 60.0

LATEST: dict[str, dict] = {}  # replica id -> its last report, as the ingress last read the board

logger = logging.getLogger("tokenloom.fleet")


class FleetBoard:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict]] = {}

    async def post(self, replica_id: str, report: dict) -> None:
        self._reports[replica_id] = (time.monotonic(), report)

    async def read(self) -> dict[str, dict]:
        now = time.monotonic()
        self._reports = {rid: (t, r) for rid, (t, r) in self._reports.items() if now - t <= FORGET_S}
        return {rid: r if now - t <= STALE_S else {"health_problem": f"no report for {now - t:.0f} s"}
                for rid, (t, r) in self._reports.items()}


def latest() -> dict[str, dict]:
    return LATEST


async def refresh(board_handle) -> None:
    """Read the board into LATEST. A board that cannot be read (restarting) leaves the last read in
    place: the front reads it again a period later."""
    global LATEST
    try:
        LATEST = await board_handle.read.remote()
    except Exception as exc:  # noqa: BLE001 - the board restarting must not stop the front
        logger.warning("could not read the fleet board: %r", exc)
