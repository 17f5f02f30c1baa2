"""Progress of a lab run set, on stderr: a line per run every few seconds, and one when each run ends.

A lab run on the real model takes minutes; a person watching should see every mode move. Plain lines
(not a redrawn bar) because the lab is as often run into a log file or a CI job as in a terminal, where
a bar's carriage returns become noise. Each line names the run and says requests finished / total,
output tokens generated / total, steps, the run's own engine time (its clock runs only in its turns)
and the wall time since the runs started.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO

DEFAULT_INTERVAL_S = 5.0


class RunState(Protocol):
    """What a progress line reads of a run in progress (`driver._Driver`)."""

    label: str
    done: bool
    finished_requests: int
    total_requests: int
    generated_tokens: int
    total_tokens: int
    steps: int
    engine_seconds: float


class LabProgress:
    """`update(runs)` after every turn: prints when `interval_s` passed since the last lines, and once
    for each run that has just finished."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, stream: TextIO | None = None,
                 clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.started = clock()
        self.last = self.started
        self.reported_done: set[str] = set()

    def update(self, runs: list[RunState]) -> None:
        now = self.clock()
        newly_done = [r for r in runs if r.done and r.label not in self.reported_done]
        if now - self.last >= self.interval_s:
            self.last = now
            for run in runs:
                if not run.done:
                    self._print(run, now)
        for run in newly_done:
            self._print(run, now)
            self.reported_done.add(run.label)

    def _print(self, run: RunState, now: float) -> None:
        width = len(str(run.total_tokens))
        state = "done" if run.done else "    "
        print(f"[{now - self.started:7.1f} s] {run.label:<22} {state} requests {run.finished_requests:>4}/"
              f"{run.total_requests:<4} tokens {run.generated_tokens:>{width}}/{run.total_tokens} "
              f"({run.generated_tokens / max(run.total_tokens, 1):4.0%})  steps {run.steps:>6}  "
              f"engine {run.engine_seconds:7.1f} s", file=self.stream, flush=True)
