"""The fleet's board (fleet/board.py) on a real local Ray cluster: reports kept in the GCS's key-value
store, read back, marked stale, forgotten; one application's board apart from another's."""

from __future__ import annotations

import asyncio

import pytest
import ray

from tokenloom.fleet import board
from tokenloom.fleet.board import FleetBoard


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run(coro):
    return asyncio.run(coro)


def post_at(notice_board: FleetBoard, replica_id: str, report: dict, seconds_ago: float, monkeypatch) -> None:
    now = board.time.time()
    monkeypatch.setattr(board.time, "time", lambda: now - seconds_ago)
    run(notice_board.post(replica_id, report))
    monkeypatch.undo()


def test_reports_are_read_back_per_replica():
    notice_board = FleetBoard("reads")
    run(notice_board.post("r1", {"waiting": 3, "health_problem": None, "metrics": "a 1\n"}))
    run(notice_board.post("r2", {"waiting": 0, "health_problem": "stalled"}))
    run(notice_board.post("r1", {"waiting": 5, "health_problem": None, "metrics": "a 2\n"}))  # the latest wins
    assert run(notice_board.read()) == {"r1": {"waiting": 5, "health_problem": None, "metrics": "a 2\n"},
                                        "r2": {"waiting": 0, "health_problem": "stalled"}}


def test_a_silent_replica_reads_as_unhealthy_then_is_forgotten(monkeypatch):
    notice_board = FleetBoard("ages")
    run(notice_board.post("fresh", {"waiting": 1, "health_problem": None}))
    post_at(notice_board, "silent", {"waiting": 9, "health_problem": None}, board.STALE_S + 5, monkeypatch)
    post_at(notice_board, "gone", {"waiting": 9, "health_problem": None}, board.FORGET_S + 5, monkeypatch)
    reports = run(notice_board.read())
    assert reports["fresh"] == {"waiting": 1, "health_problem": None}
    assert reports["silent"] == {"health_problem": f"no report for {board.STALE_S + 5:.0f} s"}  # no load, no metrics
    assert "gone" not in reports
    from ray.experimental.internal_kv import _internal_kv_list

    assert sorted(_internal_kv_list("", namespace=notice_board.namespace)) == [b"fresh", b"silent"]  # deleted


def test_applications_have_boards_of_their_own():
    one, other = FleetBoard("one"), FleetBoard("other:app")  # the store splits keys on ':'
    run(one.post("r1", {"waiting": 1}))
    run(other.post("r1", {"waiting": 2}))
    assert run(one.read()) == {"r1": {"waiting": 1}}
    assert run(other.read()) == {"r1": {"waiting": 2}}
    assert run(FleetBoard("empty").read()) == {}


def test_a_board_that_cannot_be_read_leaves_the_last_read(monkeypatch):
    notice_board = FleetBoard("refresh")
    run(notice_board.post("r1", {"waiting": 4}))
    run(board.refresh(notice_board))
    assert board.latest() == {"r1": {"waiting": 4}}

    async def unreachable():
        raise TimeoutError("the GCS did not answer")

    monkeypatch.setattr(notice_board, "read", unreachable)
    run(board.refresh(notice_board))
    assert board.latest() == {"r1": {"waiting": 4}}
    monkeypatch.setattr(board, "LATEST", {})
