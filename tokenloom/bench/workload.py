"""Synthetic workloads, one vocabulary for the lab, the simulator and the benchmarks.

A workload is a list of `WorkloadRequest(request_id, prompt_token_ids, max_tokens, arrival_time,
priority)`; arrival times are seconds from the start of the run. Requests are meant to run greedy with
``ignore_eos=True`` so their lengths are exactly ``max_tokens`` (`tokenloom.bench.replay` does so), in
the real engine and in the simulator alike.

`make_workload(name, ...)`:
- ``uniform``: every output `output_len` tokens.
- ``mixed``: output lengths half 16, half 256 (`MIXED_OUTPUT_LENS`; shuffled, seeded).
- ``long-prompt``: prompts of 384-512 tokens, output lengths half 16, half 64.
- ``poisson``: like uniform, needs a finite `request_rate`.

Prompts are `input_len` tokens, or a length drawn per request from an inclusive (lo, hi) range (default
16-32, long-prompt 384-512); their ids are random ordinary tokens (no special ids), distinct per request,
so no prefix-cache hits occur by accident. Everything arrives at t = 0 unless `request_rate` is finite:
then arrivals are a Poisson process drawn by `tokenloom.bench.arrivals.arrival_times` (the load
generator's schedule). Priorities (for the priority policy) are drawn from 0..2; SJF orders by
``max_tokens``.

`shared_prefix_workload(...)` is the fleet's case (many users behind a few system prompts): each request
is one of `num_prefixes` shared prompts of `prefix_len` tokens — each serving an equal share of the
requests (within one), in a seeded shuffled order, as `benchmarks/fleet.py`'s dataset of 8 system
prompts x 16 users — followed by a part of `suffix_len` tokens of its own; outputs are `output_len` tokens each, or one per request from a
list (`tokenloom.bench.datasets.parse_output_len_dist` draws one).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..slo import SLO
from .arrivals import arrival_times

WORKLOADS = ("uniform", "mixed", "long-prompt", "poisson")
MIXED_OUTPUT_LENS = (16, 256)
LONG_PROMPT_OUTPUT_LENS = (16, 64)
SHORT_PROMPT_LENS = (16, 32)
LONG_PROMPT_LENS = (384, 512)
_TOKEN_RANGE = (1000, 40000)  # ordinary BPE tokens in the bundled tokenizer (no special ids)


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0  # seconds after the run starts
    priority: int = 0
    slo: SLO | None = None  # its latency targets (slo.py), for the slo policy and attainment
    tenant: str | None = None  # whose share it draws on (--fairness vtc)


def random_prompt_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(length)]


def half_half(rng: random.Random, n: int, short: int, long_: int) -> list[int]:
    """`n` lengths, half `short` and half `long_` (the extra one long), shuffled by `rng`."""
    lens = [short] * (n // 2) + [long_] * (n - n // 2)
    rng.shuffle(lens)
    return lens


def make_workload(
    name: str,
    num_prompts: int,
    input_len: int | tuple[int, int] | None = None,
    output_len: int = 128,
    request_rate: float | None = math.inf,
    seed: int = 0,
    output_lens: tuple[int, int] | None = None,
) -> list[WorkloadRequest]:
    """`num_prompts` requests of the workload `name` (see module docstring), reproducible for a seed.
    `output_len` is every output of ``uniform``/``poisson``; `output_lens` overrides the (short, long)
    outputs of ``mixed`` and ``long-prompt``. `request_rate` None or inf: all at t = 0."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got {name!r}")
    if num_prompts <= 0:
        raise ValueError(f"num_prompts: must be positive, got {num_prompts}")
    rate = math.inf if request_rate is None else request_rate
    if name == "poisson" and math.isinf(rate):
        raise ValueError("request_rate: the poisson workload needs a finite --request-rate")
    if input_len is None:
        input_len = LONG_PROMPT_LENS if name == "long-prompt" else SHORT_PROMPT_LENS
    lo, hi = (input_len, input_len) if isinstance(input_len, int) else input_len
    if lo <= 0 or lo > hi or output_len <= 0:
        raise ValueError("input_len / output_len: must be positive")
    rng = random.Random(seed)
    if name in ("mixed", "long-prompt"):
        default = MIXED_OUTPUT_LENS if name == "mixed" else LONG_PROMPT_OUTPUT_LENS
        outs = half_half(rng, num_prompts, *(output_lens or default))
    else:
        outs = [output_len] * num_prompts
    times = arrival_times(num_prompts, rate, 1.0, seed)
    prio_rng = random.Random(seed + 1)  # apart, so fixed-length prompts do not depend on priorities
    return [
        WorkloadRequest(
            f"r{i:03d}",
            random_prompt_ids(rng, lo if lo == hi else rng.randint(lo, hi)),
            m,
            t,
            prio_rng.randint(0, 2),
        )
        for i, (t, m) in enumerate(zip(times, outs, strict=True))
    ]


def shared_prefix_workload(
    num_prompts: int,
    num_prefixes: int = 8,
    prefix_len: int = 512,
    suffix_len: int = 64,
    output_len: int | list[int] = 128,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """`num_prompts` requests, each a shared prefix then its own suffix (see module docstring)."""
    for name, value, least in (("num_prompts", num_prompts, 1), ("num_prefixes", num_prefixes, 1),
                               ("prefix_len", prefix_len, 0), ("suffix_len", suffix_len, 0)):
        if value < least:
            raise ValueError(f"{name}: must be at least {least}, got {value}")
    if prefix_len + suffix_len < 1:
        raise ValueError("prefix_len + suffix_len: a prompt needs at least one token")
    outs = [output_len] * num_prompts if isinstance(output_len, int) else list(output_len)
    if len(outs) != num_prompts or min(outs) < 1:
        raise ValueError(f"output_len: need {num_prompts} lengths of at least 1")
    rng = random.Random(seed)
    prefixes = [random_prompt_ids(rng, prefix_len) for _ in range(num_prefixes)]
    which = [i % num_prefixes for i in range(num_prompts)]
    rng.shuffle(which)
    times = arrival_times(num_prompts, request_rate, burstiness, seed)
    width = len(str(num_prompts - 1))
    return [
        WorkloadRequest(f"r{i:0{width}d}", prefixes[p] + random_prompt_ids(rng, suffix_len), m, t)
        for i, (p, t, m) in enumerate(zip(which, times, outs, strict=True))
    ]


def ideal_tokens(workload: list[WorkloadRequest]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of the whole workload."""
    return sum(len(r.prompt_token_ids) for r in workload), sum(r.max_tokens for r in workload)
