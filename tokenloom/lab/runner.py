"""Drives engines over a lab workload in-process and returns what happened (`RunResult` per run).

The model and tokenizer are passed in, so a caller loads the weights once; each run gets its own
engine (and KV cache). Several runs are **interleaved step by step** so that every mode
sees the same machine conditions -- on a shared CPU, runs taken one after another measure the
neighbours as much as the batching. Turns go to the run least far through its output tokens, so all
runs progress together and finish together. Each engine gets its own `EngineClock`, which advances only
during that engine's turns, so its step times, TTFTs and latencies are what it would measure alone.
Requests are added at their arrival offsets on the engine's clock (all at 0 for an offline workload);
an idle engine skips its clock ahead to the next arrival instead of sleeping.

`LabRun(pad=True)` emulates padding from the outside: every request of a static batch (B consecutive
requests in admission order; offline workloads only) asks for the batch's longest output, and only its
own tokens count (the recorder treats the rest as padding). The engine's static mode now computes the
slots of finished members as padding itself, so both variants cost the same per step; the emulation
stays as a cross-check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..sampling_params import SamplingParams
from .recorder import Recorder, RequestRecord, StepRecord
from .slots import SlotTimeline, assign_slots
from .workloads import LabRequest

WAIT_TICK_S = 0.001  # clock advance of an empty step (a dynamic batch waiting for company)


@dataclass(frozen=True)
class LabRun:
    """One configuration to run: batching mode, scheduling policy, batch size (= max_num_seqs)."""

    mode: str
    batch_size: int
    policy: str = "fcfs"
    max_wait_ms: float = 50.0
    name: str = ""
    pad: bool = False  # static only: compute finished rows until the batch ends, as a padding server does

    @property
    def label(self) -> str:
        base = f"{self.mode} (padded)" if self.pad else self.mode
        return self.name or (base if self.policy == "fcfs" else f"{base}/{self.policy}")


@dataclass
class RunResult:
    run: LabRun
    start: float  # engine clock at the start of the run
    end: float  # engine clock when the last request finished
    steps: list[StepRecord]
    requests: dict[str, RequestRecord]
    slots: SlotTimeline
    engine_config: dict = field(default_factory=dict)
    num_preemptions: int = 0

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


def padded(requests: list[LabRequest], run: LabRun) -> tuple[list[LabRequest], dict[str, int]]:
    """Requests asking for their static batch's longest output, and each one's real output length."""
    from .summary import admission_order

    if run.mode != "static" or any(r.arrival_offset for r in requests):
        raise ValueError("pad: only for static batching of an offline workload (every request at t = 0)")
    order = admission_order(requests, run.policy)
    longest: dict[str, int] = {}
    for i in range(0, len(order), run.batch_size):
        batch = order[i : i + run.batch_size]
        top = max(r.max_tokens for r in batch)
        longest.update({r.request_id: top for r in batch})
    real = {r.request_id: r.max_tokens for r in requests}
    return [replace(r, max_tokens=longest[r.request_id]) for r in requests], real


class _Driver:
    """One run in progress: its engine, clock, recorder and the requests not yet added."""

    def __init__(self, model, tokenizer, requests: list[LabRequest], run: LabRun, engine_kwargs: dict):
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
        real_lens = None
        if run.pad:
            requests, real_lens = padded(requests, run)
        self.recorder = Recorder(real_lens)
        self.engine.step_listeners.append(self.recorder)
        self.pending = sorted(requests, key=lambda r: r.arrival_offset)
        self.next = 0
        self.total_tokens = max(sum(r.max_tokens for r in self.pending), 1)

    @property
    def progress(self) -> float:
        """Fraction of the run's output tokens (padding included) generated so far."""
        return self.engine.num_generation_tokens / self.total_tokens

    @property
    def done(self) -> bool:
        return self.next >= len(self.pending) and not self.engine.has_unfinished_requests()

    def turn(self) -> None:
        """Add due arrivals, then one engine step (or skip the clock to the next arrival)."""
        self.clock.resume()
        try:
            now = self.clock()
            while self.next < len(self.pending) and self.pending[self.next].arrival_offset <= now:
                req = self.pending[self.next]
                params = SamplingParams(
                    temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True, priority=req.priority
                )
                prompt = {"prompt_token_ids": req.prompt_token_ids}
                self.engine.add_request(req.request_id, prompt, params, arrival_time=req.arrival_offset)
                self.next += 1
            if not self.engine.has_unfinished_requests():
                if self.next < len(self.pending):
                    self.clock.skip(self.pending[self.next].arrival_offset - now)
                return
            self.engine.step()
            if self.engine.last_step is not None and self.engine.last_step.num_seqs == 0:
                self.clock.skip(WAIT_TICK_S)
        finally:
            self.clock.pause()

    def result(self) -> RunResult:
        records = self.recorder.requests
        end = max((r.finished for r in records.values()), default=self.clock())
        return RunResult(
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
        )


def run_workloads(
    model, tokenizer, requests: list[LabRequest], runs: list[LabRun], interleave: bool = True, **engine_kwargs
) -> list[RunResult]:
    """Run `requests` through one engine per run; `engine_kwargs` are extra EngineConfig fields shared by
    all runs. Interleaved (the default), the next turn always goes to the run that is least far through its
    output tokens, so runs needing fewer steps take fewer turns and all runs end together: every run
    is measured over the same stretch of machine conditions (plain round robin would leave the slow
    runs to finish alone, under whatever load arrives late)."""
    drivers = [_Driver(model, tokenizer, requests, run, engine_kwargs) for run in runs]
    if interleave:
        while active := [d for d in drivers if not d.done]:
            min(active, key=lambda d: d.progress).turn()
    else:
        for d in drivers:
            while not d.done:
                d.turn()
    results = [d.result() for d in drivers]
    del drivers  # free the KV caches before the caller goes on
    return results


def run_workload(model, tokenizer, requests: list[LabRequest], run: LabRun, **engine_kwargs) -> RunResult:
    return run_workloads(model, tokenizer, requests, [run], **engine_kwargs)[0]


def warm_up(model, tokenizer, batch_size: int, **engine_kwargs) -> None:
    """A few short steps at the batch size to come, so the first measured steps pay no first-use costs
    (allocator growth, kernel selection for new shapes)."""
    requests = [LabRequest(f"w{i}", list(range(300, 324 + i)), 8) for i in range(batch_size)]
    run_workload(model, tokenizer, requests, LabRun("continuous", batch_size), **engine_kwargs)
