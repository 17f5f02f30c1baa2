"""A simulated fleet: N replicas of the simulated engine behind one router, on one virtual timeline.

Each replica is a real `LLMEngine` (its own scheduler, KV pool and prefix cache) over a `SimRunner`, as
`build_sim_engine` makes it; all share one cost model. The router is a policy of
`tokenloom.fleet.routing` — the very objects the Ray Serve router uses — fed what a live router sees:
each replica's `engine.stats()` (waiting, running, KV usage) and the policy's own in-flight counts
(`routed` when a request is sent, `completed` when it finishes).

The discrete-event loop. Events are, in time order: a step ends, a request arrives (or, disaggregated,
its KV lands on a decode replica), a step starts; at equal times in that order, so a request arriving
exactly when a step ends joins the next one, as `tokenloom.bench.replay` does. Replicas run
concurrently in virtual time: a step is planned and costed at its start (the engine's `step()` runs
then, on the replica's own `VirtualClock`, which the cost model moves to the step's end — the replica's
"busy until"), but what it produced (tokens, finished requests) reaches the router and the results only
at its end event; a replica's reported load is its `stats()` at its last step boundary (what it would
report between steps: taken as a step starts and as it ends), so no routing decision sees the future.
The fleet's time jumps from event to event (the earliest of the next arrival and the next step end), so
every replica's clock stays within one step of it. With one replica the loop takes exactly the steps
`simulate` takes.

Disaggregated prefill/decode (`Disaggregation(prefill, decode, ...)`), as `tokenloom/fleet` serves it
(fleet/replica.py): a request is routed by the policy over the P prefill replicas and runs there with
max_tokens = 1 (that token is not the client's); as it finishes, the prefill engine's `export_prefix_kv`
takes the prompt's whole cached blocks, which travel to a decode replica chosen least-loaded in
latency + bytes / bandwidth (bytes = those tokens x the model's KV bytes per token, `kv_calc`'s count);
there `import_prefix_kv` adopts them into the prefix cache (free blocks, most recently used, at most a
quarter of the free ones: memory pressure may evict them, costing a recompute) and the request is added
with its own prompt and max_tokens, so the engine's admission finds the prompt as a prefix-cache hit and
computes only its last block, then every output token (the first token the client sees comes from the
decode replica: TTFT includes the prefill, the transfer and the decode replica's queue). The engine's
own export / import run on the simulated engines (`SimRunner` moves no K/V, only counts it), so the
simulator adopts what the real decode replica adopts. The fleet's hit rate counts the prefill replicas
only; `decode_prefill_tokens` in the summary is what decode replicas computed as prefill.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from ..bench.replay import ReplayResult, VirtualClock
from ..bench.serving_metrics import BenchmarkMetrics, RequestResult, compute_metrics
from ..bench.workload import WorkloadRequest
from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..fleet.routing import ReplicaLoad, RoutingPolicy, make_policy
from ..model.config import ModelConfig
from ..model.plan import kv_cache_dtype_for
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .cost_model import CostModel
from .kv_calc import ModelShape, scale_bytes_of
from .simulator import build_sim_engine

# Event order at equal times: a step's results first, then arrivals, then steps starting.
STEP_END, ARRIVAL, STEP_START = 0, 1, 2
IDLE_TICK_S = 0.001  # as `replay`: the clock always moves on after an empty step

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclass(frozen=True)
class Disaggregation:
    """P prefill replicas, D decode replicas, and the link the KV crosses between them."""

    prefill: int
    decode: int
    bandwidth: float = 25e9  # bytes/s (a 200 Gb/s RDMA NIC)
    latency_s: float = 0.0

    def __post_init__(self):
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"disaggregate: needs at least 1 prefill and 1 decode replica, got "
                             f"{self.prefill}:{self.decode}")
        if not self.bandwidth > 0 or self.latency_s < 0:
            raise ValueError("kv_transfer_bandwidth: must be positive (and the latency not negative)")


def parse_disaggregate(spec: str) -> tuple[int, int]:
    """``P:D`` -> (P, D)."""
    p, sep, d = spec.partition(":")
    if not sep or not p.isdigit() or not d.isdigit():
        raise ValueError(f"disaggregate: expected P:D (prefill:decode replica counts), got {spec!r}")
    return int(p), int(d)


@dataclass
class ReplicaReport:
    """What one replica did over the run."""

    replica_id: str
    role: str  # "mixed", "prefill" or "decode"
    requests: int = 0  # routed to it
    steps: int = 0
    busy_s: float = 0.0  # sum of its steps' durations
    prefill_tokens: int = 0
    max_prefill_chunk: int = 0  # the longest multi-token row of any of its steps
    prefix_queries: int = 0
    prefix_hits: int = 0


@dataclass
class SimReplica:
    replica_id: str
    role: str
    engine: LLMEngine
    clock: VirtualClock
    report: ReplicaReport
    reported: ReplicaLoad
    active: bool = False  # in a step, or with its next step's start pending

    def snapshot(self) -> None:
        s = self.engine.stats()
        self.reported = ReplicaLoad(self.replica_id, s.num_waiting + s.num_swapped, s.num_running, s.kv_usage)


@dataclass
class RequestRecord:
    request: WorkloadRequest
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served where it was first admitted
    finished: float | None = None


@dataclass
class FleetResult:
    """One workload through the fleet: vLLM-style metrics (`replay`, `slo_metrics`) and the fleet's own."""

    policy: str
    replay: ReplayResult
    slo_metrics: BenchmarkMetrics  # with goodput at the SLO (None when no SLO was given)
    replicas: list[ReplicaReport]
    queue_times: list[float]  # arrival -> first scheduled on the replica that took it first
    completions: list[tuple[str, str]]  # (request id, replica it finished on), once per finish (all requests)
    prefix_hits: int  # prompt tokens served by the prefix cache, measured requests, where first admitted
    prefix_queries: int  # their prompt tokens
    run_s: float  # the whole run, warm-up included: 0 to the last finish
    disaggregated: bool = False
    warmup_s: float = 0.0

    @property
    def requests(self) -> list[RequestResult]:
        return self.replay.requests

    def _serving(self) -> list[ReplicaReport]:
        return [r for r in self.replicas if r.role != "decode"]

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served by the prefix cache / prompt tokens, over the measured requests, on the
        replica that took each first (vLLM's counters count the same, at first admission)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def load_spread(self) -> dict[str, float]:
        """Requests per serving replica: min, max, and max / mean (1 = perfectly even)."""
        counts = [r.requests for r in self._serving()]
        mean = sum(counts) / len(counts)
        return {"min": min(counts), "max": max(counts), "max_over_mean": max(counts) / mean if mean else 0.0}

    def summary(self) -> dict:
        m, lat = self.replay.metrics, self.replay.metrics.latency_stats
        q = self.queue_times or [0.0]
        busy = [r.busy_s / self.run_s for r in self.replicas]
        out = {
            "policy": self.policy,
            "replicas": len(self.replicas),
            "completed": m.completed,
            "duration_s": self.replay.duration,
            "request_throughput": m.request_throughput,
            "output_throughput": m.output_throughput,
            "goodput": self.slo_metrics.request_goodput,
            "goodput_fraction": (self.slo_metrics.request_goodput * self.replay.duration / m.completed
                                 if self.slo_metrics.request_goodput is not None and m.completed else None),
            "prefix_hit_rate": self.prefix_hit_rate,
            **{f"{stat}_{name}_ms": lat[f"{stat}_{name}_ms"]
               for name in ("ttft", "tpot", "e2el") for stat in ("mean", "median", "p90", "p99")},
            "mean_queue_ms": 1000 * float(np.mean(q)),
            "p99_queue_ms": 1000 * float(np.percentile(q, 99)),
            "load_spread": self.load_spread(),
            "busy_fraction": {"min": min(busy), "mean": sum(busy) / len(busy), "max": max(busy)},
            "num_steps": self.replay.num_steps,
            "warmup_s": self.warmup_s,
            "measured_requests": len(self.replay.requests),
        }
        if self.disaggregated:
            decode = [r for r in self.replicas if r.role == "decode"]
            out["decode_prefill_tokens"] = sum(r.prefill_tokens for r in decode)
            out["decode_max_prefill_chunk"] = max(r.max_prefill_chunk for r in decode)
        return out


def kv_bytes_per_token(model_config: ModelConfig, config: EngineConfig) -> int:
    """The KV one token holds, as `kv-calc` counts it, in the KV dtype the engine's plan would choose."""
    quantization = "none" if config.quantization in (None, "none") else config.quantization
    dtype = kv_cache_dtype_for(quantization, config.dtype, config.kv_cache_dtype)
    shape = ModelShape(model_config.num_layers, model_config.num_kv_heads, model_config.dim_per_head,
                       DTYPE_BYTES[dtype], scale_bytes=scale_bytes_of(dtype))
    return shape.kv_bytes_per_token


def policy_for(name: str, config: EngineConfig, num_blocks: int) -> RoutingPolicy:
    """The routing policy by flag name; prefix-aware mirrors each replica's cache at its block size and
    block count."""
    kwargs = {"block_size": config.block_size, "blocks_per_replica": num_blocks} if name == "prefix-aware" else {}
    return make_policy(name, **kwargs)


class FleetSim:
    """The event loop over `replicas` (see module docstring); `run()` once."""

    def __init__(self, replicas: list[SimReplica], policy: RoutingPolicy, workload: list[WorkloadRequest],
                 disaggregation: Disaggregation | None = None, kv_bytes_per_token: int = 0,
                 slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, warmup_s: float = 0.0,
                 serving_path_s: float = 0.0):
        self.replicas = replicas
        self.policy = policy
        self.workload = workload
        self.disagg = disaggregation
        self.kv_bytes_per_token = kv_bytes_per_token
        self.slos = (slo_ttft_ms, slo_tpot_ms)
        self.warmup_s = warmup_s
        self.serving_path_s = serving_path_s
        self.front = [r for r in replicas if r.role != "decode"]  # where arrivals go
        self.back = [r for r in replicas if r.role == "decode"]
        self.decode_policy = make_policy("least-loaded") if self.back else None
        self.records = {req.request_id: RequestRecord(req) for req in workload}
        if len(self.records) != len(workload):
            raise ValueError("workload: request ids must be unique")
        self.arrivals = sorted(workload, key=lambda r: r.arrival_time)
        self.next_arrival = 0
        self.events: list = []
        self._order = itertools.count()
        self.now = 0.0
        self.completions: list[tuple[str, str]] = []
        self.num_steps = 0

    # -- the loop ------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, action: Callable, *args) -> None:
        heapq.heappush(self.events, (t, kind, next(self._order), action, args))

    def run(self) -> FleetResult:
        for req in self.arrivals:
            self._push(req.arrival_time, ARRIVAL, self._arrive, req)
        while self.events:
            self.now, _, _, action, args = heapq.heappop(self.events)
            action(*args)
        return self._result()

    def _wake(self, replica: SimReplica, at: float | None = None) -> None:
        if not replica.active:
            replica.active = True
            self._push(self.now if at is None else at, STEP_START, self._start, replica)

    def _start(self, replica: SimReplica) -> None:
        assert replica.clock() <= self.now, "a replica's clock ran ahead of the fleet's"
        replica.clock.sleep_until(self.now)
        replica.snapshot()
        outputs = replica.engine.step()
        self.num_steps += 1
        step = replica.engine.last_step
        rep = replica.report
        rep.steps += 1
        rep.busy_s += step.duration
        rep.prefill_tokens += step.num_prefill_tokens
        rep.max_prefill_chunk = max(rep.max_prefill_chunk, *(n for n, _ in step.shape.rows if n > 1), 0)
        self._push(replica.clock(), STEP_END, self._end, replica, outputs, step.num_seqs == 0)

    def _end(self, replica: SimReplica, outputs: list[RequestOutput], empty: bool) -> None:
        for out in outputs:
            self._deliver(replica, out)
        replica.snapshot()  # what it reports until its next step starts (idle: from now on)
        replica.active = False
        if not replica.engine.has_unfinished_requests():
            return
        if empty:  # nothing could run (a dynamic batch waiting for company): as `replay` waits
            due = replica.engine.scheduler.batch_due_time()
            wake = due if due is not None and due > self.now else self.now + IDLE_TICK_S
            self._wake(replica, min(self._next_arrival_time(), wake))
        else:
            self._wake(replica)

    def _next_arrival_time(self) -> float:
        return self.arrivals[self.next_arrival].arrival_time if self.next_arrival < len(self.arrivals) else math.inf

    # -- requests ------------------------------------------------------------------------------

    def _route(self, policy: RoutingPolicy, pool: list[SimReplica], prompt_ids: list[int]) -> SimReplica:
        by_id = {r.replica_id: r for r in pool}
        chosen = by_id[policy.rank(prompt_ids, [r.reported for r in pool])[0]]
        policy.routed(chosen.replica_id, prompt_ids)
        chosen.report.requests += 1
        return chosen

    def _arrive(self, req: WorkloadRequest) -> None:
        self.next_arrival += 1
        replica = self._route(self.policy, self.front, req.prompt_token_ids)
        max_tokens = 1 if self.disagg is not None else req.max_tokens
        replica.engine.add_request(req.request_id, {"prompt_token_ids": req.prompt_token_ids},
                                   greedy(max_tokens, req.priority), req.arrival_time)
        self._wake(replica)

    def _deliver(self, replica: SimReplica, out: RequestOutput) -> None:
        """A step's output reaches the fleet at the step's end (`self.now`)."""
        rec = self.records[out.request_id]
        if replica.role != "prefill":  # a prefill replica's token is not the client's (see module docstring)
            rec.token_times.extend([self.now] * (len(out.outputs[0].token_ids) - len(rec.token_times)))
        if rec.first_scheduled is None:  # its first output: it was scheduled in this step or before
            # (`RequestMetrics` reads a first-scheduled time of 0.0 as none: a virtual clock starts at 0.)
            rec.first_scheduled = out.metrics.first_scheduled_time or 0.0
            rec.cached_tokens = out.num_cached_tokens
        if not out.finished:
            return
        if replica.role == "prefill":
            self.policy.completed(replica.replica_id)
            tokens, kv = replica.engine.export_prefix_kv(rec.request.prompt_token_ids)  # its blocks, still cached
            delay = self.disagg.latency_s + tokens * self.kv_bytes_per_token / self.disagg.bandwidth
            self._push(self.now + delay, ARRIVAL, self._hand_off, rec, kv)
            return
        (self.decode_policy if replica.role == "decode" else self.policy).completed(replica.replica_id)
        rec.finished = self.now
        self.completions.append((out.request_id, replica.replica_id))

    # -- disaggregation ------------------------------------------------------------------------

    def _hand_off(self, rec: RequestRecord, kv) -> None:
        req = rec.request
        replica = self._route(self.decode_policy, self.back, req.prompt_token_ids)
        replica.engine.import_prefix_kv(req.prompt_token_ids, kv)
        replica.engine.add_request(req.request_id, {"prompt_token_ids": req.prompt_token_ids},
                                   greedy(req.max_tokens, req.priority), req.arrival_time)
        self._wake(replica)

    # -- results -------------------------------------------------------------------------------

    def _result(self) -> FleetResult:
        """Metrics over the requests arriving after the warm-up (every request must have finished);
        times from the warm-up's end."""
        for rec in self.records.values():
            if rec.finished is None:
                raise RuntimeError(f"fleet simulation: request {rec.request.request_id} never finished")
        measured = [self.records[r.request_id] for r in self.workload if r.arrival_time >= self.warmup_s]
        if not measured:
            raise ValueError(f"warmup_s: no request arrives after the warm-up ({self.warmup_s} s)")
        results = []
        for rec in measured:
            req, times, path = rec.request, rec.token_times, self.serving_path_s
            results.append(RequestResult(
                success=True, prompt_len=len(req.prompt_token_ids), output_tokens=len(times),
                ttft=times[0] - req.arrival_time + path, itl=[b - a for a, b in itertools.pairwise(times)],
                latency=rec.finished - req.arrival_time + path, start_time=req.arrival_time - self.warmup_s,
            ))
        for replica in self.replicas:
            replica.engine.check_kv_invariants()
            stats = replica.engine.stats()
            replica.report.prefix_queries, replica.report.prefix_hits = stats.prefix_queries, stats.prefix_hits
        duration = max(r.start_time + r.latency for r in results)
        replay = ReplayResult(results, duration, self.num_steps)
        slo = compute_metrics(results, duration, *self.slos)
        queue = [rec.first_scheduled - rec.request.arrival_time for rec in measured]
        return FleetResult(self.policy.name, replay, slo, [r.report for r in self.replicas], queue,
                           self.completions, sum(rec.cached_tokens for rec in measured),
                           sum(len(rec.request.prompt_token_ids) for rec in measured),
                           max(rec.finished for rec in self.records.values()), self.disagg is not None, self.warmup_s)


def greedy(max_tokens: int, priority: int = 0) -> SamplingParams:
    """What `replay` sends: exactly `max_tokens` tokens."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def build_replicas(cost_model: CostModel, roles: Seq[str], config: EngineConfig | None = None,
                   model_config: ModelConfig | None = None, tokenizer=None) -> list[SimReplica]:
    """One simulated engine per role, each its own KV pool, prefix cache and clock."""
    if tokenizer is None:
        from ..model.loader import bundled_model_path
        from ..model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(bundled_model_path())  # once for all: it only detokenizes
    replicas = []
    for i, role in enumerate(roles):
        engine, clock = build_sim_engine(cost_model, dataclasses.replace(config or EngineConfig()), model_config,
                                         tokenizer, seed=i)
        rid = f"{role[0]}{i}" if role != "mixed" else f"r{i}"
        replicas.append(SimReplica(rid, role, engine, clock, ReplicaReport(rid, role), ReplicaLoad(rid)))
    return replicas


def simulate_fleet(
    cost_model: CostModel,
    workload: list[WorkloadRequest],
    num_replicas: int = 2,
    routing_policy: str = "round-robin",
    config: EngineConfig | None = None,
    model_config: ModelConfig | None = None,
    tokenizer=None,
    disaggregation: Disaggregation | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    warmup_s: float = 0.0,
    serving_path_s: float = 0.0,
) -> FleetResult:
    """Run `workload` over `num_replicas` simulated engines behind `routing_policy` (or, with
    `disaggregation`, over its prefill and decode replicas; `num_replicas` is then ignored). Requests
    arriving in the first `warmup_s` seconds warm the caches and queues but are not measured.
    `serving_path_s`: what the serving path adds to each request's first token and end, outside the
    engine (the HTTP front, Ray's hops, the stream to the client)."""
    result = _run_fleet(cost_model, workload, num_replicas, routing_policy, config, model_config, tokenizer,
                        disaggregation, slo_ttft_ms, slo_tpot_ms, warmup_s, serving_path_s)
    # Each `LLMEngine` freezes what exists when built (gc.freeze), so the engines built before the last
    # one are frozen too and their reference cycles would outlive the run: ~3 MB a replica, every run.
    # The result holds no engine; let the collector have them.
    gc.unfreeze()
    gc.collect()
    return result


def _run_fleet(cost_model, workload, num_replicas, routing_policy, config, model_config, tokenizer, disaggregation,
               slo_ttft_ms, slo_tpot_ms, warmup_s, serving_path_s) -> FleetResult:
    if disaggregation is None:
        if num_replicas < 1:
            raise ValueError(f"replicas: must be at least 1, got {num_replicas}")
        roles = ["mixed"] * num_replicas
    else:
        roles = ["prefill"] * disaggregation.prefill + ["decode"] * disaggregation.decode
    replicas = build_replicas(cost_model, roles, config, model_config, tokenizer)
    first = replicas[0].engine
    policy = policy_for(routing_policy, first.config, first.kv.prefix_capacity)
    sim = FleetSim(replicas, policy, workload, disaggregation, kv_bytes_per_token(first.model_config, first.config),
                   slo_ttft_ms, slo_tpot_ms, warmup_s, serving_path_s)
    return sim.run()
