"""A `Sequence` is one generated completion: the unit the scheduler, the KV cache and the runner see.

A request with `n > 1` becomes n sequences with the same prompt; they share the prompt's full KV
blocks through the prefix cache. Invariant: `num_computed_tokens <= num_tokens`; the KV of the first
`num_computed_tokens` tokens lives in the blocks of `block_table` (or in `host_blocks` when swapped).
Whenever a step brings `num_computed_tokens` up to `num_tokens`, the sequence samples its next token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..outputs import TokenLogprobs
from ..sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    # Everything after this line is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}



@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        generator: torch.Generator | None = None,
    ):
        self.request_id = request_id
        self.index = index
        self.seq_id = f"{request_id}#{index}"
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_keys: list = []  # prefix-cache keys of full blocks, computed incrementally
        self.host_blocks: list[int] = []  # host-pool blocks while swapped out
        self.num_cached_prompt_tokens = 0  # prompt tokens served by the prefix cache (first admission)
        self.num_preemptions = 0
        self.times = SequenceTimes(arrival=arrival_time if arrival_time is not None else time.monotonic())
        # Outputs
        self.output_text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] = []
        self.stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.name}, computed={self.num_computed_tokens}/{self.num_tokens},"
            f" blocks={self.block_table})"
        )
