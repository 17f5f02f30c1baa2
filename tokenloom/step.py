"""The runner seam (a leaf module): the `Sequence`, the `StepPlan` the scheduler makes, the `StepResult`s
a `Runner` (`ModelRunner`, the simulator's `SimRunner`) returns. A `Sequence` is one generated completion.
A request with `n > 1` becomes n sequences with the same prompt; they share the prompt's full KV
blocks through the prefix cache. Invariant: `num_computed_tokens <= num_tokens`; the KV of the first
`num_computed_tokens` tokens lives in the blocks of `block_tables` (or in `host_blocks` when swapped).
Whenever a step brings `num_computed_tokens` up to `num_tokens`, the sequence samples its next token.
Speculative drafts (`spec_token_ids`, set for one step) are scored after a decoding sequence's last
token in the same row; they are not in `token_ids` until accepted, so nothing (the prefix cache's
keys, stop checks) ever sees a draft that was not.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from .outputs import TokenLogprobs
from .sampling_params import SamplingParams

if TYPE_CHECKING:  # torch for annotations only: the simulator and the CLI's flags import this module
    import torch

    from .model.lora import LoRAWeights


HOLE = -1  # a block-table entry whose block fell behind its group's sliding window and was released


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    # Everything after this line is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5


FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort"}


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, generator: torch.Generator | None = None):
        self.request_id = request_id
        self.index = index
        self.seq_id = f"{request_id}#{index}"
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # One table per KV group (model/kv_layout.py): one unless the model has sliding-window layers.
        self.block_tables: list[list[int]] = []
        self.num_registered_blocks = 0  # of its full blocks, how many were offered to the prefix cache
        self.block_keys: list = []  # prefix-cache keys of full blocks, computed incrementally
        self.host_blocks: list[int] = []  # host-pool blocks while swapped out
        self.num_cached_prompt_tokens = 0  # prompt tokens served by the prefix cache (first admission)
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # drafts to verify in this step (engine/speculation.py)
        self.lora: LoRAWeights | None = None  # the LoRA adapter it runs under (pinned while it runs)
        self.times = SequenceTimes(arrival=arrival_time if arrival_time is not None else time.monotonic())
        # Outputs
        self.output_text = ""
        self.logprobs: list[TokenLogprobs] = []
        # params.pool_hidden: the sum of the final hidden state over positions [0, hidden_count)
        self.hidden_sum = None
        self.hidden_count = 0
        self.prompt_hidden = None  # its mean over the prompt's positions alone, once they all ran
        self.prompt_logprobs: list[TokenLogprobs | None] = []
        self.stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def step_token_ids(self, start: int, end: int) -> list[int]:
        """The tokens at positions [start, end) of this step's row: known tokens, then the drafts."""
        known = self.token_ids[start:end]
        return known + self.spec_token_ids[: end - start - len(known)] if end > self.num_tokens else known

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table: every block of the sequence's computed tokens."""
        return self.block_tables[0] if self.block_tables else []

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
        return self.status >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.name}, computed={self.num_computed_tokens}/{self.num_tokens},"
            f" blocks={self.block_table})"
        )


def samples(seq: Sequence, n: int) -> bool:
    """Does a row of `n` tokens sample? Yes when it brings the computed tokens up to the known ones
    (and through this step's drafts, which it then verifies)."""
    return seq.num_computed_tokens + n == seq.num_tokens + len(seq.spec_token_ids)


def is_decode(n: int) -> bool:
    """A one-token row: one query (a decode, or a one-token prefill chunk), run as a decode."""
    return n == 1


class TokenMask(Protocol):
    """A grammar's view of one sequence: writes the allowed next tokens as a bitmask row."""

    def fill_bitmask(self, row: torch.Tensor) -> None: ...


@dataclass
class RowConstraint:
    """What a sampling row may produce, applied in this order: bias, allowed ids, banned ids, grammar."""

    banned_ids: tuple[int, ...] = ()  # e.g. stop tokens under `min_tokens`, the ends of bad words
    logit_bias: dict[int, float] | None = None  # added to the logits (OpenAI's logit_bias)
    allowed_ids: tuple[int, ...] | None = None  # only these may be sampled (vLLM's allowed_token_ids)
    grammar: TokenMask | None = None  # structured outputs: only what the grammar admits next


@dataclass
class StepShape:
    """The batch shape of a step: per row (tokens computed, context length after the step)."""

    rows: list[tuple[int, int]]
    num_sampled: int
    num_swap_blocks: int
    num_draft_rows: int = 0  # rows that decode and carry speculative drafts


@dataclass
class StepPlan:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Static/dynamic batching: slots of the batch whose request already finished. A static server still
    # computes them (padding); the runner does so by repeating a live decode row.
    num_padding: int = 0
    # scheduled index -> what its sampled rows may produce: one per row (the last token, then each draft)
    constraints: dict[int, list[RowConstraint | None]] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @cached_property
    def shape(self) -> StepShape:
        """Read before the step advances the sequences (cached from the first read)."""
        rows = [(n, s.num_computed_tokens + n) for s, n in self.scheduled]
        sampled = sum(samples(s, n) for s, n in self.scheduled)
        drafted = sum(1 for s, _ in self.scheduled if s.spec_token_ids)
        return StepShape(rows, sampled, len(self.swap_in) + len(self.swap_out), drafted)


@dataclass
class StepResult:
    """What one forward produced for one scheduled sequence."""

    seq: Sequence
    num_tokens: int
    token_id: int | None  # None: a prefill chunk that did not reach the end of the known tokens
    logprobs: TokenLogprobs | None = None
    accepted: list[int] = field(default_factory=list)  # drafts accepted, in order, before `token_id`
    accepted_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None  # for prompt tokens [start+1, start+n]


class Runner(Protocol):
    """Turns a step plan into one forward (or its simulated cost)."""

    last_forward_time: float  # seconds inside the forward in the last `execute`

    def execute(self, plan: StepPlan) -> list[StepResult]: ...
