"""A serving engine's steps on file, to fit the simulator's cost model on the traffic it really served.

`tokenloom serve --record-steps FILE` appends one JSON line per step that ran tokens: when it started
and ended (the engine's monotonic clock), the seconds of it in the model forward, whether the engine
still had work when it ended, and the step's `StepFeatures`. A fleet's replicas each write their own
file (the replica's pid before the suffix). `tokenloom calibrate --from-steps FILE...` fits the linear
cost model on these instead of running the calibration grid on a quiet engine.

Why: the grid measures one engine alone on the machine. A replica shares it with the other replicas,
Ray's processes, the HTTP front and the clients, and its steps took about twice as long as that grid
predicted on 2 cores. The simulator's clock must advance by what a step costs *there*, including the
engine loop's own time between two busy steps (posting outputs, taking requests, waiting for the GIL),
which `StepStats.duration` does not contain: `busy_step_times` adds it to the step before it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from .cost_model import StepFeatures, step_features

if TYPE_CHECKING:
    from .llm_engine import LLMEngine, StepStats


def replica_path(path: str, tag: str) -> str:
    """`path` with `-tag` before its suffix: one file per fleet replica."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{tag}{p.suffix}"))


class StepLog:
    """A step listener appending each step that ran tokens to `path`, one JSON object a line."""

    def __init__(self, engine: LLMEngine, path: str):
        self.engine = engine
        try:
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the engine's lifetime, a line at a time
        except OSError as exc:
            raise ValueError(f"--record-steps: cannot write {path}: {exc.strerror}") from None
        engine.step_listeners.append(self._on_step)

    def _on_step(self, stats: StepStats, _outputs) -> None:
        if not stats.shape.rows:
            return
        features = step_features(stats.shape, self.engine.config.block_size)
        self._file.write(json.dumps({"start": stats.start, "end": stats.start + stats.duration,
                                     "forward": stats.forward_time, "busy_after": self.engine.has_unfinished_requests(),
                                     "features": asdict(features)}) + "\n")

    def close(self) -> None:
        self.engine.step_listeners.remove(self._on_step)
        self._file.close()


def busy_step_times(records: list[dict]) -> list[tuple[StepFeatures, float]]:
    """(features, seconds) per recorded step of one engine (`read_step_records`), in order: a step that left work behind
    lasts until the next step starts (the engine loop's time between them is part of its cost); the
    last step of a busy period lasts its own duration."""
    samples = []
    for rec, nxt in zip(records, [*records[1:], None], strict=True):
        end = nxt["start"] if nxt is not None and rec["busy_after"] and nxt["start"] >= rec["end"] else rec["end"]
        samples.append((rec["features"], end - rec["start"]))
    return samples


def read_step_records(path: str) -> list[dict]:
    """One file's step records, in order (start, end, forward — None in files written before it was
    recorded —, busy_after, features); a line that is not a step record is a ValueError naming the file
    and line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--from-steps: cannot read {path}: {exc.strerror}") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            rec = json.loads(line)
            forward = rec.get("forward")
            records.append({"start": float(rec["start"]), "end": float(rec["end"]),
                            "forward": None if forward is None else float(forward),
                            "busy_after": bool(rec["busy_after"]), "features": StepFeatures(**rec["features"])})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"--from-steps: {path} line {n} is not a step record ({exc})") from None
    return records


def read_step_logs(paths: list[str]) -> list[tuple[StepFeatures, float]]:
    """Every file's steps (each file one engine) as fitting samples (`read_step_records`' errors)."""
    return [sample for path in paths for sample in busy_step_times(read_step_records(path))]
