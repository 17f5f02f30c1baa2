"""Discrete-event simulator: the real `LLMEngine`, scheduler and KV cache, with a cost model as the model.

`SimRunner` stands in for `ModelRunner`: for each planned step it advances a `VirtualClock` by the cost
model's predicted step time and returns one token for every sequence whose step reaches the end of its
known tokens (exactly the rows the real runner samples). Everything else — admission, chunked prefill,
preemption, prefix caching, batching modes, stop conditions, metrics timestamps — is the engine's own code.

`drive(engine, workload, ...)` is the one request-injection loop, used for the simulator (virtual clock;
idle time is skipped by jumping the clock to the next arrival) and for the real engine in the fidelity
benchmark (wall clock; idle time is slept). Before every step it adds each request whose arrival time
has passed, with that arrival time, so a request that arrives mid-step waits for the step to end, as it
would in a server. Metrics follow `tokenloom.bench.metrics` (vLLM's definitions): TTFT = first token -
arrival, TPOT = (E2E - TTFT) / (output tokens - 1), duration = last finish - start of the run.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..bench.metrics import BenchmarkMetrics, RequestResult, compute_metrics
from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..model.llama import LlamaConfig
from ..sampling_params import SamplingParams
from ..step import Runner, StepPlan, StepResult, samples
from .cost_model import MODELS, CostModel, StepFeatures, step_features
from .workloads import WorkloadRequest

SIM_TOKEN_ID = 1000  # an ordinary token every simulated sequence "generates"
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


class SimRunner(Runner):
    """A runner whose forward is a cost-model prediction on a virtual clock."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock, block_size: int, token_id: int = SIM_TOKEN_ID):
        self.cost_model = cost_model
        self.clock = clock
        self.block_size = block_size
        self.token_id = token_id
        self.last_forward_time = 0.0
        self.steps: list[tuple[StepFeatures, float]] = []

    def execute(self, plan: StepPlan) -> list[StepResult]:
        if plan.is_empty and not (plan.swap_in or plan.swap_out):
            self.last_forward_time = 0.0
            return []
        feats = step_features(plan.shape, self.block_size)
        dt = self.cost_model.predict(feats)
        self.clock.advance(dt)
        self.last_forward_time = dt
        self.steps.append((feats, dt))
        return [
            StepResult(seq, n, self.token_id if samples(seq, n) else None) for seq, n in plan.scheduled
        ]


@dataclass
class RunResult:
    """One workload run (real or simulated): per-request results and the vLLM-style aggregates."""

    requests: list[RequestResult]
    duration: float
    num_steps: int
    metrics: BenchmarkMetrics = field(init=False)

    def __post_init__(self):
        self.metrics = compute_metrics(self.requests, self.duration)

    def summary(self) -> dict[str, float]:
        m = self.metrics.to_dict()
        keys = ("completed", "output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms",
                "median_e2el_ms", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms", "p99_tpot_ms")
        return {"duration_s": self.duration, "num_steps": self.num_steps, **{k: m[k] for k in keys}}


def drive(
    engine: LLMEngine,
    workload: list[WorkloadRequest],
    sleep_until: Callable[[float], None],
    on_step: Callable[[], None] | None = None,
) -> RunResult:
    """Run `workload` to completion on `engine`, injecting requests at their arrival times (offsets from
    the moment this is called, on `engine.clock`). `sleep_until(t)` waits (or jumps) to clock time t."""
    clock = engine.clock
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    t0 = clock()
    token_times: dict[str, list[float]] = {}
    outputs = {}
    nxt = steps = 0
    while nxt < len(pending) or engine.has_unfinished_requests():
        now = clock()
        while nxt < len(pending) and t0 + workload[pending[nxt]].arrival_time <= now:
            i = pending[nxt]
            req = workload[i]
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": req.prompt_token_ids}, params, t0 + req.arrival_time)
            token_times[str(i)] = []
            nxt += 1
        if not engine.has_unfinished_requests():
            sleep_until(t0 + workload[pending[nxt]].arrival_time)
            continue
        step_outputs = engine.step()
        steps += 1
        if on_step is not None:
            on_step()
        end = clock()
        for out in step_outputs:
            times = token_times[out.request_id]
            times.extend([end] * (len(out.outputs[0].token_ids) - len(times)))
            if out.finished:
                outputs[out.request_id] = out
        if engine.last_step is not None and engine.last_step.num_seqs == 0:
            wake = t0 + workload[pending[nxt]].arrival_time if nxt < len(pending) else math.inf
            sleep_until(min(wake, clock() + IDLE_TICK_S))
    results = []
    for i, req in enumerate(workload):
        out = outputs[str(i)]
        m = out.metrics
        times = token_times[str(i)]
        results.append(RequestResult(
            success=True,
            prompt_len=len(req.prompt_token_ids),
            output_tokens=len(out.outputs[0].token_ids),
            ttft=m.first_token_time - m.arrival_time,
            itl=[b - a for a, b in itertools.pairwise(times)],
            latency=m.finished_time - m.arrival_time,
            start_time=m.arrival_time - t0,
        ))
    duration = max(r.start_time + r.latency for r in results)
    return RunResult(results, duration, steps)


def build_sim_engine(
    cost_model: CostModel,
    config: EngineConfig | None = None,
    model_config: LlamaConfig | None = None,
    tokenizer=None,
) -> tuple[LLMEngine, VirtualClock]:
    """An `LLMEngine` over a `SimRunner`. The pretended model defaults to the preset's model (roofline
    cost models) or the bundled SmolLM2-135M (calibrated ones); the tokenizer only detokenizes."""
    if tokenizer is None:
        from ..model.loader import bundled_model_path
        from ..model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(bundled_model_path())
    if model_config is None:
        model_config = getattr(cost_model, "model_config", None) or MODELS["smollm2-135m"]
    config = config or EngineConfig()
    clock = VirtualClock()
    runner = SimRunner(cost_model, clock, config.block_size)
    engine = LLMEngine(config, tokenizer=tokenizer, runner=runner, model_config=model_config, clock=clock)
    return engine, clock


def simulate(
    cost_model: CostModel,
    workload: list[WorkloadRequest],
    config: EngineConfig | None = None,
    model_config: LlamaConfig | None = None,
    tokenizer=None,
) -> RunResult:
    """Run `workload` through the real scheduler and KV cache on a virtual clock."""
    engine, clock = build_sim_engine(cost_model, config, model_config, tokenizer)
    result = drive(engine, workload, clock.sleep_until)
    engine.check_kv_invariants()
    return result


def run_real(engine: LLMEngine, workload: list[WorkloadRequest], on_step=None) -> RunResult:
    """Run `workload` on a real engine in this thread with the wall clock (idle time is slept)."""

    def sleep_until(t: float) -> None:
        delay = t - engine.clock()
        if delay > 0:
            time.sleep(delay)

    return drive(engine, workload, sleep_until, on_step)
