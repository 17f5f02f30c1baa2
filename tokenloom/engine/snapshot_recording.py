"""Dashboard snapshots recorded per step, for a replay of a run the dashboard page can step through.

`SnapshotRecording(engine, label)` attaches the live dashboard's `EngineRecorder` to an engine and
`capture()`s a snapshot (the very frame format the live page draws, engine/snapshot.py) after a step;
the lab and `tokenloom simulate` call it between steps, off the engine's clock. `write_replay` stores
the runs in one gzipped JSON file (`replay.json.gz`), `read_replay` loads and checks one.

Bounded: a run keeps at most `max_frames` frames. It starts with every step; whenever the frames would
exceed the cap, every other one is dropped and the stride doubles, so a run of any length ends with
between max_frames / 2 and max_frames frames evenly spaced in steps (the first step's always kept; the
last step's too, appended by `finish()`). Frames that will be dropped are never built: a snapshot is
built only on steps on the current stride. A frame of the lab's default engine is a few kB of JSON
(most of it the KV map, one character per block, and the charts' per-second buckets), which gzip
shrinks several times over.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

REPLAY_FORMAT = "tokenloom-replay"
REPLAY_VERSION = 1
DEFAULT_MAX_FRAMES = 400  # per run
REPLAY_FILE = "replay.json.gz"


class SnapshotRecording:
    """The frames of one run: `capture()` after each step, `finish()` once the run is over."""

    def __init__(self, engine, label: str, max_frames: int = DEFAULT_MAX_FRAMES, model_name: str = ""):
        if max_frames < 2:
            raise ValueError(f"max_frames: must be at least 2, got {max_frames}")
        self.engine = engine
        self.label = label
        self.max_frames = max_frames
        from .snapshot import EngineRecorder  # here, not at the top: the CLI's flags read this module

        self.recorder = EngineRecorder(engine, model_name)
        self.recorder.watched = True  # keep what the live page keeps only while watched (preemption times)
        self.frames: list[dict] = []
        self.stride = 1
        self._last_step = 0

    def capture(self) -> None:
        """A frame of the engine as it is now, if a step ran since the last call and it falls on the stride."""
        step = self.engine.num_steps
        if step == self._last_step:
            return
        self._last_step = step
        if (step - 1) % self.stride:
            return
        self.frames.append(self.recorder.build())
        if len(self.frames) > self.max_frames:
            self.frames = self.frames[::2]
            self.stride *= 2

    def finish(self) -> None:
        """Add the last step's frame when the stride skipped it (a run's end is worth seeing)."""
        if self._last_step and (not self.frames or self.frames[-1]["step"]["number"] != self._last_step):
            if len(self.frames) == self.max_frames:
                self.frames.pop()
            self.frames.append(self.recorder.build())

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "num_steps": self._last_step, "stride": self.stride, "frames": self.frames}


def write_replay(path: str, runs: list[SnapshotRecording], meta: dict[str, Any]) -> str:
    """Write the runs' frames to `path` (gzipped JSON; a directory gets REPLAY_FILE inside); returns the path."""
    if os.path.isdir(path):
        path = os.path.join(path, REPLAY_FILE)
    data = {"format": REPLAY_FORMAT, "version": REPLAY_VERSION, **meta, "runs": [r.to_dict() for r in runs]}
    body = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
    # mtime=0: the same run writes the same bytes.
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(body)
    return path


def resolve_replay_path(path: str) -> str:
    """A replay file, or a directory holding REPLAY_FILE (a lab output directory)."""
    if os.path.isdir(path):
        path = os.path.join(path, REPLAY_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"replay: no file at {path} (run `tokenloom lab --out DIR` or `tokenloom simulate "
                         f"--record-replay FILE` first)")
    return path


def read_replay(path: str) -> dict[str, Any]:
    """Load and check a replay file: a ValueError says what is wrong with it."""
    path = resolve_replay_path(path)
    try:
        with gzip.open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"replay: {path} is not a gzipped JSON replay ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != REPLAY_FORMAT:
        raise ValueError(f"replay: {path} is not a {REPLAY_FORMAT} file")
    if data.get("version") != REPLAY_VERSION:
        raise ValueError(f"replay: {path} has version {data.get('version')!r}; this tokenloom reads {REPLAY_VERSION}")
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs or not all(
        isinstance(r, dict) and isinstance(r.get("frames"), list) and r["frames"] for r in runs
    ):
        raise ValueError(f"replay: {path} has no run with frames")
    return data
