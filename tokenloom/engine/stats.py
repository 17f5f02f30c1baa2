"""The engine's stats: what each step did (`StepStats`, handed to the step listeners), the engine's
state at one moment (`EngineStats`) and the failures it survived (`FaultStats`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import step as steps
from ..outputs import RequestOutput
from ..step import Runner, StepPlan, StepShape
from .kv_cache import KVCacheManager
from .scheduler import Scheduler
from .speculation import SpeculationPolicy


@dataclass
class FaultStats:
    """Failures the engine survived, for tests, logs and the reliability report."""

    requests_failed_alone: int = 0  # a per-request error (sampler row, detokenization, logprobs, output)
    requests_failed_collateral: int = 0  # failed with a step whose batched forward raised
    forward_failures: int = 0
    consecutive_forward_failures: int = 0


@dataclass
class StepStats:
    """What one step did, for metrics, logs and the batching lab."""

    start: float
    duration: float
    num_seqs: int
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    seq_ids: list[str]
    shape: StepShape  # per-row (tokens, context) of the step: what calibration fits against
    forward_time: float = 0.0  # inside the model forward (the rest of `duration` is engine overhead)
    num_padding: int = 0  # static/dynamic batching: finished members' slots computed as padding
    num_draft_tokens: int = 0  # speculative drafts scored in the step (counted in num_batched_tokens)
    num_accepted_tokens: int = 0  # of those, accepted
    row_drafts: list[int] | None = None  # per row of `shape`, its speculative drafts (the dashboard's rows)


@dataclass
class EngineStats:
    """The engine's state at one moment, for metrics, logs, the lab and admission control."""

    num_running: int
    num_waiting: int  # waiting to be (re)admitted, not counting swapped-out sequences
    num_swapped: int
    kv_usage: float
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int
    num_preemptions: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @classmethod
    def of(cls, sched: Scheduler, kv: KVCacheManager) -> EngineStats:
        swapped = sched.num_swapped
        return cls(len(sched.running), len(sched.waiting) - swapped, swapped, kv.usage, kv.prefix_queries,
                   kv.prefix_hits, sched.num_preemptions)


StepListener = Callable[[StepStats, list[RequestOutput]], None]


class StepMetrics:
    """Records each step's `StepStats` (the last one in `last_step`) and hands it to the listeners
    (metrics, the lab, the stall-free budget); a decode-only step's time also feeds speculation's
    step-cost fit."""

    def __init__(self, runner: Runner, speculation: SpeculationPolicy | None):
        self.runner, self.speculation = runner, speculation
        self.last_step: StepStats | None = None
        self.listeners: list[StepListener] = []

    def record(self, plan: StepPlan, start: float, end: float, outputs: list[RequestOutput],
               num_drafts: int = 0, num_accepted: int = 0, row_drafts: list[int] | None = None) -> None:
        # A row with drafts decodes one token and scores the drafts (rows are (tokens, context) pairs).
        decode = sum(1 for n, _ in plan.shape.rows if steps.is_decode(n)) + plan.shape.num_draft_rows
        stats = StepStats(
            start=start,
            duration=end - start,
            num_seqs=len(plan.scheduled),
            num_batched_tokens=plan.num_batched_tokens,
            num_prefill_tokens=plan.num_batched_tokens - decode - num_drafts,
            num_decode_tokens=decode,
            num_preempted=len(plan.preempted),
            seq_ids=[s.seq_id for s, _ in plan.scheduled],
            shape=plan.shape,
            forward_time=getattr(self.runner, "last_forward_time", 0.0),
            num_padding=plan.num_padding,
            num_draft_tokens=num_drafts,
            num_accepted_tokens=num_accepted,
            row_drafts=row_drafts,
        )
        if self.speculation is not None and stats.num_prefill_tokens == 0:
            self.speculation.observe_step(stats.num_batched_tokens, stats.duration)
        self.last_step = stats
        for listener in self.listeners:
            listener(stats, outputs)
