"""Records a run: every non-empty engine step and every finished request (an `LLMEngine` step listener).

The padding rows a static batch computes for its finished members are the engine's own business: they
are not in the step's sequences, so `num_seqs` (occupancy) counts useful rows and the slot timeline
shows those slots idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.llm_engine import StepStats
from ..outputs import RequestOutput


def request_of(seq_id: str) -> str:
    """Sequence ids are ``request_id#index``; the lab runs n = 1, so a sequence is its request."""
    return seq_id.rsplit("#", 1)[0]


@dataclass
class StepRecord:
    index: int
    start: float  # engine clock (seconds)
    duration: float
    forward_time: float
    num_seqs: int
    num_batched_tokens: int
    num_prefill_tokens: int
    request_ids: list[str]  # requests doing useful work in this step
    finished_ids: list[str] = field(default_factory=list)
    num_draft_tokens: int = 0  # speculative drafts scored (inside num_batched_tokens)
    num_accepted_tokens: int = 0


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    output_len: int
    arrival: float
    first_scheduled: float
    first_token: float
    finished: float

    @property
    def latency(self) -> float:
        return self.finished - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


class Recorder:
    """Append to `engine.step_listeners`; empty steps (a dynamic batch still waiting) are skipped."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.requests: dict[str, RequestRecord] = {}

    def __call__(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        if stats.num_seqs == 0:
            return
        end = stats.start + stats.duration
        useful = [request_of(s) for s in stats.seq_ids]
        finished = []
        for out in outputs:
            if out.finished:
                finished.append(out.request_id)
                self._record(out, len(out.outputs[0].token_ids), end)
        self.steps.append(
            StepRecord(
                index=len(self.steps),
                start=stats.start,
                duration=stats.duration,
                forward_time=stats.forward_time,
                num_seqs=len(useful),
                num_batched_tokens=stats.num_batched_tokens,
                num_prefill_tokens=stats.num_prefill_tokens,
                request_ids=useful,
                finished_ids=finished,
                num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
            )
        )

    def _record(self, out: RequestOutput, output_len: int, end: float) -> None:
        m = out.metrics
        self.requests[out.request_id] = RequestRecord(
            request_id=out.request_id,
            prompt_len=len(out.prompt_token_ids),
            output_len=output_len,
            arrival=m.arrival_time,
            first_scheduled=m.first_scheduled_time or m.arrival_time,
            first_token=m.first_token_time or end,
            finished=end,
        )
