"""The one arrival-injection loop: replay a workload through an `LLMEngine` on the engine's own clock.

`Replay(engine, workload)` adds, before every step, each request whose arrival time has passed (offsets
from the moment the replay starts, on `engine.clock`), with that arrival time, so a request arriving
mid-step waits for the step to end as it would in a server; then it runs one `engine.step()`. The clock
is pluggable through the engine: a clock with ``sleep_until(t)`` (the simulator's `VirtualClock`, the
lab's per-engine clock) jumps over idle time; any other callable (the wall clock, `time.monotonic` by
default) is slept on. Idle means no unfinished request (wait for the next arrival) or an empty step
(dynamic batching waiting for company: to its timer or the next arrival, whichever is sooner; otherwise
`IDLE_TICK_S`).

`turn()` is one iteration, so a caller can interleave several engines step by step (the lab);
`replay(engine, workload)` runs one to completion. Both the simulator (virtual clock) and the real
engine (wall clock; the fidelity benchmark) use it, so their results mean the same. Metrics follow
`tokenloom.bench.serving_metrics` (vLLM's definitions): TTFT = first token - arrival, TPOT = (E2E -
TTFT) / (output tokens - 1), duration = last finish - start of the run. Requests with an SLO are judged as
the server judges them (`slo.Attainment`, the same code): `ReplayResult.slo`, and in `summary()` the
attainment of TTFT, TPOT and both and the goodput (requests meeting both per second of the run); a request
refused under --slo-shed is a failed request that met nothing.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.llm_engine import LLMEngine
from ..engine.slo_policy import SLOShedError
from ..sampling_params import SamplingParams
from ..slo import ATTAINMENT_KINDS, Attainment
from .serving_metrics import BenchmarkMetrics, RequestResult, compute_metrics
from .workload import WorkloadRequest

IDLE_TICK_S = 0.001  # clock advance when a step schedules nothing (e.g. dynamic batching is waiting)


class VirtualClock:
    """A clock that only moves when told to; callable like `time.monotonic`."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += max(dt, 0.0)

    def sleep_until(self, t: float) -> None:
        self.now = max(self.now, t)


def wall_sleeper(clock: Callable[[], float]) -> Callable[[float], None]:
    """`sleep_until(t)` for a clock that moves by itself: sleep the difference."""

    def sleep_until(t: float) -> None:
        delay = t - clock()
        if delay > 0:
            time.sleep(delay)

    return sleep_until


@dataclass
class ReplayResult:
    """One workload replayed (real or simulated): per-request results and the vLLM-style aggregates."""

    requests: list[RequestResult]
    duration: float
    num_steps: int
    metrics: BenchmarkMetrics = field(init=False)
    snapshots: object | None = field(default=None, compare=False)  # a SnapshotRecording, when one was made
    slo: Attainment | None = field(default=None, compare=False)  # when any request had an SLO

    def __post_init__(self):
        self.metrics = compute_metrics(self.requests, self.duration)

    def summary(self) -> dict[str, float]:
        m = self.metrics.to_dict()
        keys = ("completed", "output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms",
                "median_e2el_ms", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms", "p99_tpot_ms")
        out = {"duration_s": self.duration, "num_steps": self.num_steps, **{k: m[k] for k in keys}}
        if self.slo is not None and self.slo.requests:
            out.update({f"slo_attained_{k}": self.slo.met[k] / self.slo.requests for k in ATTAINMENT_KINDS})
            out.update(slo_shed=self.slo.shed, goodput=self.slo.met["both"] / self.duration)
        return out


class Replay:
    """`workload` being replayed on `engine`; `on_step()` is called after every step."""

    def __init__(self, engine: LLMEngine, workload: list[WorkloadRequest], on_step: Callable[[], None] | None = None):
        self.engine = engine
        self.workload = workload
        self.on_step = on_step
        self.clock = engine.clock
        self.sleep_until = getattr(self.clock, "sleep_until", None) or wall_sleeper(self.clock)
        self.pending = sorted(workload, key=lambda r: r.arrival_time)
        self.next = 0
        self.num_steps = 0
        self.token_times: dict[str, list[float]] = {}
        self.outputs = {}
        self.refused: set[str] = set()  # shed (--slo-shed)
        self.attainment = Attainment(window_s=math.inf)
        self.t0 = self.clock()

    @property
    def done(self) -> bool:
        return self.next >= len(self.pending) and not self.engine.has_unfinished_requests()

    def _next_arrival(self) -> float:
        return self.t0 + self.pending[self.next].arrival_time if self.next < len(self.pending) else math.inf

    def turn(self) -> None:
        """Add due arrivals, then one engine step (or wait for the next arrival)."""
        engine = self.engine
        while self._next_arrival() <= self.clock():
            req = self.pending[self.next]
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True,
                                    priority=req.priority, slo=req.slo, tenant=req.tenant)
            prompt = {"prompt_token_ids": req.prompt_token_ids}
            self.token_times[req.request_id] = []
            self.next += 1
            try:
                engine.add_request(req.request_id, prompt, params, self.t0 + req.arrival_time)
            except SLOShedError:
                self.refused.add(req.request_id)
                self.attainment.add_shed(self.clock())
        if not engine.has_unfinished_requests():
            if self.next < len(self.pending):
                self.sleep_until(self._next_arrival())
            return
        step_outputs = engine.step()
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step()
        end = self.clock()
        for out in step_outputs:
            times = self.token_times[out.request_id]
            times.extend([end] * (len(out.outputs[0].token_ids) - len(times)))
            if out.finished:
                self.outputs[out.request_id] = out
                self.attainment.add_output(out, end)
        if engine.last_step is not None and engine.last_step.num_seqs == 0:
            due, now = engine.scheduler.batch_due_time(), self.clock()
            wake = due if due is not None and due > now else now + IDLE_TICK_S  # the clock always moves on
            self.sleep_until(min(self._next_arrival(), wake))

    def run(self) -> ReplayResult:
        while not self.done:
            self.turn()
        return self.result()

    def result(self) -> ReplayResult:
        """Per-request results in workload order (every request must have finished)."""
        results = []
        for req in self.workload:
            if req.request_id in self.refused:
                results.append(RequestResult(error="refused: predicted to miss its SLO (--slo-shed)",
                                             prompt_len=len(req.prompt_token_ids),
                                             start_time=req.arrival_time))
                continue
            out = self.outputs[req.request_id]
            m = out.metrics
            times = self.token_times[req.request_id]
            results.append(RequestResult(
                success=True,
                prompt_len=len(req.prompt_token_ids),
                output_tokens=len(out.outputs[0].token_ids),
                ttft=m.first_token_time - m.arrival_time,
                itl=[b - a for a, b in itertools.pairwise(times)],
                latency=m.finished_time - m.arrival_time,
                start_time=m.arrival_time - self.t0,
            ))
        duration = max(r.start_time + r.latency for r in results)
        return ReplayResult(results, duration, self.num_steps,
                            slo=self.attainment if self.attainment.requests else None)


def replay(
    engine: LLMEngine, workload: list[WorkloadRequest], on_step: Callable[[], None] | None = None
) -> ReplayResult:
    """Run `workload` to completion on `engine`, injecting requests at their arrival times."""
    return Replay(engine, workload, on_step).run()
