"""What the engine returns, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass

from .slo import SLO

TokenLogprobs = dict[int, float]  # token id -> logprob, highest first, the chosen token always present


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # with finish_reason "error": what went wrong (an internal error)
    pooled_hidden: list[float] | None = None  # with SamplingParams.pool_hidden: the mean final hidden state
    prompt_hidden: list[float] | None = None  # ... and its mean over the prompt alone

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    # An internal error ended this request (and only this one); finished is True and every
    # completion's finish_reason is "error". The server answers it with a 500 / an SSE error event.
    error: str | None = None
    num_preemptions: int = 0
    slo: SLO | None = None  # the request's targets (slo.py), for the server's attainment counters


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # An internal error ended this request (and only this one); finished is True and every
    # completion's finish_reason is "error". The server answers it with a 500 / an SSE error event.
    error: str | None = None
