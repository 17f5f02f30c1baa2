"""Seeded synthetic workloads for the simulator and the fidelity benchmark.

A workload is a list of `WorkloadRequest(arrival_time, prompt_token_ids, max_tokens)`; arrival times are
seconds from the start of the run. Requests are meant to run with ``ignore_eos=True`` so their lengths
are exactly ``max_tokens``, in the real engine and in the simulator alike.

- ``uniform``: every request has --input-len prompt tokens and --output-len output tokens.
- ``mixed``: --input-len prompt tokens; output lengths half 16, half 256 (shuffled, seeded).
- ``poisson``: like uniform, arriving as a Poisson process at --request-rate (exponential gaps, drawn
  by `tokenloom.bench.arrivals.arrival_times`, the load generator's schedule).

``uniform`` and ``mixed`` send everything at t = 0 unless a request rate is given. Prompts are random
ordinary token ids (no special tokens), distinct per request, so no prefix-cache hits occur by accident.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..bench.arrivals import arrival_times

WORKLOADS = ("uniform", "mixed", "poisson")
MIXED_OUTPUT_LENS = (16, 256)
_TOKEN_RANGE = (1000, 40000)  # ordinary BPE tokens in the bundled tokenizer (no special ids)


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_time: float
    prompt_token_ids: list[int]
    max_tokens: int


def random_prompt_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(length)]


def make_workload(
    name: str,
    num_prompts: int,
    input_len: int = 128,
    output_len: int = 64,
    request_rate: float = math.inf,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """`num_prompts` requests of the workload `name` (see module docstring), reproducible for a seed."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got {name!r}")
    if num_prompts <= 0:
        raise ValueError(f"num_prompts: must be positive, got {num_prompts}")
    if input_len <= 0 or output_len <= 0:
        raise ValueError("input_len / output_len: must be positive")
    if name == "poisson" and math.isinf(request_rate):
        raise ValueError("request_rate: the poisson workload needs a finite --request-rate")
    rng = random.Random(seed)
    if name == "mixed":
        short, long_ = MIXED_OUTPUT_LENS
        outs = [short] * (num_prompts // 2) + [long_] * (num_prompts - num_prompts // 2)
        rng.shuffle(outs)
    else:
        outs = [output_len] * num_prompts
    times = arrival_times(num_prompts, request_rate, 1.0, seed)
    return [
        WorkloadRequest(t, random_prompt_ids(rng, input_len), m) for t, m in zip(times, outs, strict=True)
    ]


def ideal_tokens(workload: list[WorkloadRequest]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of the whole workload."""
    return sum(len(r.prompt_token_ids) for r in workload), sum(r.max_tokens for r in workload)
