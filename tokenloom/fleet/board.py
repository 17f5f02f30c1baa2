"""The fleet's notice board: each engine replica posts its load, health and metrics every second; the
front reads them all back every second.

The board is the cluster's own key-value store (Ray's GCS), a key per replica under the application's
namespace, so it is no process of its own. (It was a Serve deployment of one replica: one more Ray
worker on the engines' cores, which woke ~250 times a second while idle — Ray's core worker checks for
signals every 10 ms on its main thread — and each wake-up preempts an engine thread mid-step.)

The front keeps the last read in `LATEST`, a process-local table that its request router (ray_router.py,
running in the same process) ranks replicas by and that /health and /metrics read. A replica that
stops posting (its event loop frozen, or dead) reads as unhealthy after `STALE_S`, with no load or
metrics, and its key is deleted after `FORGET_S` (Ray Serve will have replaced it by then). Reports
carry the wall-clock time they were posted at: the store keeps no times of its own.
"""

from __future__ import annotations

import functools
import json
import logging
import time

from . import ray_env  # noqa: F401  (before Ray, imported in the functions below: its pacing)

REPORT_PERIOD_S = 1.0
STALE_S = 5.0
FORGET_S = 60.0
GCS_TIMEOUT_S = 5.0

LATEST: dict[str, dict] = {}  # replica id -> its last report, as the front last read the board

logger = logging.getLogger("tokenloom.fleet")


class FleetBoard:
    """A handle on one fleet application's board: plain data, bound into its deployments."""

    def __init__(self, app_name: str | None = None) -> None:
        """`app_name`: the fleet's Serve application; None where the board is used inside one of its
        replicas, which know it (`serve run` names the application after the board is bound)."""
        self.app_name = app_name

    @functools.cached_property
    def namespace(self) -> bytes:
        from ray import serve

        name = self.app_name or serve.get_replica_context().app_name
        return f"tokenloom-board-{name}".replace(":", "-").encode()  # the store splits keys on ':'

    async def post(self, replica_id: str, report: dict) -> None:
        entry = json.dumps({"posted": time.time(), "report": report}).encode()
        await _gcs().async_internal_kv_put(replica_id.encode(), entry, True, self.namespace, timeout=GCS_TIMEOUT_S)

    async def read(self) -> dict[str, dict]:
        gcs, now = _gcs(), time.time()
        keys = await gcs.async_internal_kv_keys(b"", self.namespace, timeout=GCS_TIMEOUT_S)
        entries = await gcs.async_internal_kv_multi_get(keys, self.namespace, timeout=GCS_TIMEOUT_S) if keys else {}
        reports = {}
        for key, raw in entries.items():
            entry = json.loads(raw)
            age = now - entry["posted"]
            if age > FORGET_S:
                await gcs.async_internal_kv_del(key, False, self.namespace, timeout=GCS_TIMEOUT_S)
            else:
                reports[key.decode()] = entry["report"] if age <= STALE_S else {"health_problem": f"no report for {age:.0f} s"}
        return reports


def _gcs():
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    return internal_kv_get_gcs_client()


def latest() -> dict[str, dict]:
    return LATEST


async def refresh(notice_board: FleetBoard) -> None:
    """Read the board into LATEST. A board that cannot be read (the GCS busy or restarting) leaves the
    last read in place: the front reads it again a period later."""
    global LATEST
    try:
        LATEST = await notice_board.read()
    except Exception as exc:  # noqa: BLE001 - the store being unreachable must not stop the front
        logger.warning("could not read the fleet board: %r", exc)
