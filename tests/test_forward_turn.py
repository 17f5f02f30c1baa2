"""The forward turn: engines in one process take turns at the CPU, one whole step each, FIFO."""

from __future__ import annotations

import threading
import time

import pytest

from tokenloom.engine.forward_turn import ForwardTurn


def test_turn_is_exclusive_and_round_robin_over_engines_with_work():
    turn = ForwardTurn()
    order: list[str] = []
    running = []
    overlap = []

    def engine(name: str, steps: int):
        for _ in range(steps):
            turn.acquire()
            try:
                running.append(name)
                if len(running) > 1:
                    overlap.append(tuple(running))
                order.append(name)
                time.sleep(0.002)  # a forward
                running.remove(name)
            finally:
                turn.release()

    threads = [threading.Thread(target=engine, args=(n, 30)) for n in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlap  # never two forwards at once
    assert sorted(order) == sorted("abc" * 30)
    # While all three have work, each steps once before any steps twice (FIFO hand-off): in every window
    # of three consecutive steps in the middle, the three engines appear once each.
    middle = order[6:-6]
    assert all(len(set(middle[i:i + 3])) == 3 for i in range(0, len(middle) - 3, 3)), order
    assert turn.turns == 90 and turn.num_waiting == 0


def test_turn_idle_engine_costs_nothing_and_release_without_hold_is_an_error():
    turn = ForwardTurn()
    for _ in range(3):  # one engine alone takes the turn at once, again and again
        turn.acquire()
        turn.release()
    with pytest.raises(RuntimeError, match="not held"):
        turn.release()
