"""ForwardTurn: several engines in one process take turns at the CPU, one whole step at a time.

Two engine threads running forwards at once on the same cores slow each other far more than 2x (two
spinning OpenMP teams of all the cores each). So every engine thread that has work takes the turn for
one `LLMEngine.step()` (schedule, forward, sample) and gives it back after. The turn is FIFO with
direct hand-off: a thread that wants it again queues behind the ones already waiting, so the models
with waiting work step round-robin, one step each, and an idle model (not asking) costs nothing. No
model starves: a waiting thread gets the turn after at most one step of every other model.

Each thread still sets its own torch thread count (all the usable cores): only one runs at a time.
"""

from __future__ import annotations

import threading
from collections import deque


class ForwardTurn:
    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: deque[threading.Event] = deque()
        self._held = False
        self.turns = 0  # steps taken under this turn (all engines)

    def acquire(self) -> None:
        with self._lock:
            if not self._held and not self._waiting:
                self._held = True
                self.turns += 1
                return
            ready = threading.Event()
            self._waiting.append(ready)
        ready.wait()  # the releaser hands the turn over directly: `_held` stays True

    def release(self) -> None:
        with self._lock:
            if not self._held:
                raise RuntimeError("ForwardTurn.release: the turn is not held")
            if self._waiting:
                self.turns += 1
                self._waiting.popleft().set()
            else:
                self._held = False

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

