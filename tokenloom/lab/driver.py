"""Drives engines over a lab workload in-process and returns what happened (`LabResult` per run).

The model and tokenizer are passed in, so a caller loads the weights once; each run gets its own
engine (and KV cache). Several runs are **interleaved step by step** so that every mode
sees the same machine conditions -- on a shared CPU, runs taken one after another measure the
neighbours as much as the batching. Turns go to the run least far through its output tokens, so all
runs progress together and finish together. Each engine gets its own `EngineClock`, which advances only
during that engine's turns, so its step times, TTFTs and latencies are what it would measure alone.
A turn is one iteration of `tokenloom.bench.replay.Replay` (requests added at their arrival times on the
engine's clock, all at 0 for an offline workload); an idle engine skips its clock ahead to the next
arrival instead of sleeping.

Optionally each run records dashboard snapshots (`engine.snapshot_recording`, for `tokenloom
dashboard-replay`), captured after its turn with its clock paused, so recording costs the measured run
nothing; and a `LabProgress` prints where every run is, every few seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..bench.replay import Replay
from ..bench.workload import WorkloadRequest
from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..engine.snapshot_recording import SnapshotRecording
from .progress import LabProgress
from .recorder import Recorder, RequestRecord, StepRecord
from .slots import SlotTimeline, assign_slots


@dataclass(frozen=True)
class LabRun:
    """One configuration to run: batching mode, scheduling policy, batch size (= max_num_seqs)."""

    mode: str
    batch_size: int
    policy: str = "fcfs"
    max_wait_ms: float = 50.0
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or (self.mode if self.policy == "fcfs" else f"{self.mode}/{self.policy}")


@dataclass
class LabResult:
    run: LabRun
    start: float  # engine clock at the start of the run
    end: float  # engine clock when the last request finished
    steps: list[StepRecord]
    requests: dict[str, RequestRecord]
    slots: SlotTimeline
    engine_config: dict = field(default_factory=dict)
    num_preemptions: int = 0
    snapshots: SnapshotRecording | None = None  # dashboard frames, when recorded

    @property
    def label(self) -> str:
        return self.run.label

    @property
    def wall_time(self) -> float:
        return self.end - self.start


class EngineClock:
    """Seconds of this engine's own turns: runs between `resume()` and `pause()`, can `skip()` ahead."""

    def __init__(self) -> None:
        self.elapsed = 0.0
        self.resumed: float | None = None

    def __call__(self) -> float:
        running = time.perf_counter() - self.resumed if self.resumed is not None else 0.0
        return self.elapsed + running

    def resume(self) -> None:
        self.resumed = time.perf_counter()

    def pause(self) -> None:
        self.elapsed = self()
        self.resumed = None

    def skip(self, seconds: float) -> None:
        self.elapsed += max(seconds, 0.0)

    def sleep_until(self, t: float) -> None:
        self.skip(t - self())


class _Driver:
    """One run in progress: its engine, clock, recorder and replay of the workload."""

    def __init__(self, model, tokenizer, requests: list[WorkloadRequest], run: LabRun, engine_kwargs: dict,
                 max_frames: int | None = None):
        self.run = run
        self.config = EngineConfig(
            batching=run.mode,
            max_num_seqs=run.batch_size,
            scheduling_policy=run.policy,
            max_wait_ms=run.max_wait_ms,
            **engine_kwargs,
        )
        self.clock = EngineClock()
        self.engine = LLMEngine(self.config, model=model, tokenizer=tokenizer, clock=self.clock)
        self.recorder = Recorder()
        self.engine.step_listeners.append(self.recorder)
        self.replay = Replay(self.engine, requests)
        self.total_tokens = max(sum(r.max_tokens for r in requests), 1)
        self.total_requests = len(requests)
        self.snapshots = SnapshotRecording(self.engine, run.label, max_frames) if max_frames else None

    @property
    def label(self) -> str:
        return self.run.label

    @property
    def progress(self) -> float:
        """Fraction of the run's output tokens generated so far."""
        return self.engine.num_generation_tokens / self.total_tokens

    @property
    def generated_tokens(self) -> int:
        return self.engine.num_generation_tokens

    @property
    def finished_requests(self) -> int:
        return len(self.recorder.requests)

    @property
    def steps(self) -> int:
        return self.engine.num_steps

    @property
    def engine_seconds(self) -> float:
        return self.clock()

    @property
    def done(self) -> bool:
        return self.replay.done

    def turn(self) -> None:
        """One replay turn (due arrivals, then one engine step), timed on this engine's clock only."""
        self.clock.resume()
        try:
            self.replay.turn()
        finally:
            self.clock.pause()
        if self.snapshots is not None:
            self.snapshots.capture()

    def result(self) -> LabResult:
        if self.snapshots is not None:
            self.snapshots.finish()
        records = self.recorder.requests
        end = max((r.finished for r in records.values()), default=self.clock())
        return LabResult(
            run=self.run,
            start=0.0,
            end=end,
            steps=self.recorder.steps,
            requests=records,
            slots=assign_slots(
                self.recorder.steps, hold_until_batch_end=self.run.mode in ("static", "dynamic")
            ),
            engine_config={k: v for k, v in vars(self.config).items() if k != "model"},
            num_preemptions=self.engine.stats().num_preemptions,
            snapshots=self.snapshots,
        )


def run_workloads(
    model,
    tokenizer,
    requests: list[WorkloadRequest],
    runs: list[LabRun],
    interleave: bool = True,
    progress: LabProgress | None = None,
    max_frames: int | None = None,
    **engine_kwargs,
) -> list[LabResult]:
    """Run `requests` through one engine per run; `engine_kwargs` are extra EngineConfig fields shared by
    all runs. Interleaved (the default), the next turn always goes to the run that is least far through its
    output tokens, so runs needing fewer steps take fewer turns and all runs end together: every run
    is measured over the same stretch of machine conditions (plain round robin would leave the slow
    runs to finish alone, under whatever load arrives late). `progress` is told after every turn;
    `max_frames` > 0 records up to that many dashboard snapshots per run (`LabResult.snapshots`)."""
    drivers = [_Driver(model, tokenizer, requests, run, engine_kwargs, max_frames) for run in runs]
    if interleave:
        while active := [d for d in drivers if not d.done]:
            min(active, key=lambda d: d.progress).turn()
            if progress is not None:
                progress.update(drivers)
    else:
        for d in drivers:
            while not d.done:
                d.turn()
                if progress is not None:
                    progress.update(drivers)
    results = [d.result() for d in drivers]
    del drivers  # free the KV caches before the caller goes on
    return results


def run_workload(model, tokenizer, requests: list[WorkloadRequest], run: LabRun, **engine_kwargs) -> LabResult:
    return run_workloads(model, tokenizer, requests, [run], **engine_kwargs)[0]


def warm_up(model, tokenizer, batch_size: int, **engine_kwargs) -> None:
    """A few short steps at the batch size to come, so the first measured steps pay no first-use costs
    (allocator growth, kernel selection for new shapes)."""
    requests = [WorkloadRequest(f"w{i}", list(range(300, 324 + i)), 8) for i in range(batch_size)]
    run_workload(model, tokenizer, requests, LabRun("continuous", batch_size), **engine_kwargs)
