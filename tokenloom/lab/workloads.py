"""Lab workloads: lists of requests (prompt token ids, output length, priority), seeded.

- ``mixed``: short prompts (16-32 tokens), output lengths half 16 and half 256, shuffled.
- ``uniform``: short prompts, every output 128 tokens (static and continuous should tie).
- ``long-prompt``: prompts of 384-512 tokens, output lengths half 16 and half 64.

Prompts are random token ids (no tokenizer needed, lengths exact); every request uses greedy
sampling with ``ignore_eos`` so it produces exactly its output length. Priorities (for the priority
policy) are drawn from 0..2; ``predicted_output_len`` is left unset, so SJF orders by ``max_tokens``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("mixed", "uniform", "long-prompt")


@dataclass(frozen=True)
class LabRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    arrival_offset: float = 0.0  # seconds after the run starts


def _half_half(rng: random.Random, n: int, short: int, long_: int) -> list[int]:
    lens = [short] * (n // 2) + [long_] * (n - n // 2)
    rng.shuffle(lens)
    return lens


def make_workload(
    name: str,
    num_prompts: int,
    seed: int = 0,
    request_rate: float | None = None,
    output_lens: tuple[int, int] | None = None,
) -> list[LabRequest]:
    """`num_prompts` requests of workload `name`; all arrive at once unless `request_rate` (Poisson, req/s).
    `output_lens` overrides the (short, long) output lengths of ``mixed`` and ``long-prompt``."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)} (got {name!r})")
    if num_prompts <= 0:
        raise ValueError(f"num_prompts: must be positive (got {num_prompts})")
    rng = random.Random(seed)
    if name == "mixed":
        lens = _half_half(rng, num_prompts, *(output_lens or (16, 256)))
        prompt_range = (16, 32)
    elif name == "uniform":
        lens = [output_lens[1] if output_lens else 128] * num_prompts
        prompt_range = (16, 32)
    else:
        lens = _half_half(rng, num_prompts, *(output_lens or (16, 64)))
        prompt_range = (384, 512)
    requests, t = [], 0.0
    for i, max_tokens in enumerate(lens):
        prompt = [rng.randrange(200, 40000) for _ in range(rng.randint(*prompt_range))]
        if request_rate:
            t += rng.expovariate(request_rate)
        requests.append(
            LabRequest(f"r{i:03d}", prompt, max_tokens, rng.randint(0, 2), t if request_rate else 0.0)
        )
    return requests
