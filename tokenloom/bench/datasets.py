"""Benchmark prompt sets: `random`, `mixed` and `PATH.jsonl`, with output-length distributions.

The client has no tokenizer, so synthetic prompts are words drawn (seeded) from a fixed list of common
English words; one such word with its leading space is about one token for BPE tokenizers, so
``prompt_len`` is an estimate (``prompt_len_exact`` False) until `align_prompts` asks the server's
``POST /tokenize`` ({"model", "prompt"} -> {"tokens", "count"}) and adds/removes words until the count
matches --input-len (best effort: any failure leaves the prompts as they are).

Datasets:
- ``random``: N prompts of --input-len words, output length from --output-len-dist (default fixed);
  with a range ratio r > 0 (vLLM's --random-range-ratio) each prompt's and each output's length is
  drawn uniformly from [floor(len * (1 - r)), ceil(len * (1 + r))] instead, as vLLM draws them.
- ``mixed``: like random, default output lengths half short half long (`bench.workload`'s
  ``MIXED_OUTPUT_LENS``, 16 and 256), shuffled (seeded).
- ``*.jsonl``: one {"prompt": str, "max_tokens": int?} per line, cycled if --num-prompts exceeds the
  file; max_tokens comes from the line unless --output-len-dist is given (else --output-len).

Output-length distributions (`parse_output_len_dist`): ``fixed`` (= --output-len), ``uniform:a,b``
(integers, inclusive), ``mixed:short,long`` (half/half, shuffled).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from .workload import MIXED_OUTPUT_LENS, half_half

_WORD_TEXT = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which one "
    "you were her all she there would their we him been has when who will more no if out so said what up "
    "its about into than them can only other new some could time these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three city house "
    "water light river music story paper table window garden market school number family system program"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class SampleRequest:
    """One request to send: prompt text, its (estimated) token count and max_tokens."""

    prompt: str | list[int]  # text, or token ids (/v1/completions)
    prompt_len: int
    max_tokens: int
    prompt_len_exact: bool = False
    extra: dict | None = None  # more body fields of this request (e.g. `user`, `priority`, `slo`)


def parse_output_len_dist(spec: str, output_len: int, n: int, seed: int) -> list[int]:
    """`n` output lengths drawn from `spec` (see module docstring), reproducible for a seed."""
    rng = random.Random(seed)
    kind, _, rest = spec.partition(":")
    try:
        if kind == "fixed":
            lens = [int(rest) if rest else output_len] * n
        elif kind == "uniform":
            a, b = (int(x) for x in rest.split(","))
            if a > b:
                raise ValueError
            lens = [rng.randint(a, b) for _ in range(n)]
        elif kind == "mixed":
            pair = tuple(int(x) for x in rest.split(",")) if rest else MIXED_OUTPUT_LENS
            lens = half_half(rng, n, *pair)
        else:
            raise ValueError
    except (ValueError, TypeError):
        raise ValueError(f"bad --output-len-dist {spec!r}: use fixed, uniform:a,b or mixed:short,long") from None
    if any(length < 1 for length in lens):
        raise ValueError(f"output lengths must be >= 1 (got {spec!r})")
    return lens


def random_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, num_words)))


def load_samples(
    dataset: str,
    num_prompts: int,
    input_len: int = 128,
    output_len: int = 128,
    output_len_dist: str | None = None,
    seed: int = 0,
    range_ratio: float = 0.0,
) -> list[SampleRequest]:
    """Build `num_prompts` samples of `dataset` (random | mixed | path to a .jsonl file)."""
    if num_prompts <= 0:
        raise ValueError("--num-prompts must be positive")
    if range_ratio:
        if dataset != "random":
            raise ValueError(f"--random-range-ratio: only for the random dataset (got {dataset!r})")
        return _ranged_random_samples(num_prompts, input_len, output_len, range_ratio, seed)
    if dataset in ("random", "mixed"):
        dist = output_len_dist or ("mixed" if dataset == "mixed" else "fixed")
        lens = parse_output_len_dist(dist, output_len, num_prompts, seed + 1)
        rng = random.Random(seed)
        return [SampleRequest(random_prompt(rng, input_len), input_len, m) for m in lens]
    path = Path(dataset)
    if path.suffix != ".jsonl" or not path.is_file():
        raise ValueError(f"--dataset must be random, mixed or an existing .jsonl file, got {dataset!r}")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            # ValueError (not TypeError): the CLI reports ValueErrors as usage errors.
            msg = f"{path}:{lineno}: each line must be an object with a string 'prompt'"
            raise ValueError(msg)  # noqa: TRY004
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no prompts")
    rows = [rows[i % len(rows)] for i in range(num_prompts)]
    dist_lens = parse_output_len_dist(output_len_dist or "fixed", output_len, num_prompts, seed + 1)
    samples = []
    for row, dist_len in zip(rows, dist_lens, strict=True):
        from_file = row.get("max_tokens")
        max_tokens = int(from_file) if from_file is not None and output_len_dist is None else dist_len
        samples.append(SampleRequest(row["prompt"], len(row["prompt"].split()), max_tokens))
    return samples


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def _ranged_random_samples(
    num_prompts: int, input_len: int, output_len: int, ratio: float, seed: int
) -> list[SampleRequest]:
    """Random prompts whose input and output lengths vary by +-ratio around the given ones."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio: must be in [0, 1), got {ratio}")
    rng, len_rng = random.Random(seed), random.Random(seed + 1)
    samples = []
    for _ in range(num_prompts):
        n_in = len_rng.randint(*_length_range(input_len, ratio))
        n_out = len_rng.randint(*_length_range(output_len, ratio))
        samples.append(SampleRequest(random_prompt(rng, n_in), n_in, n_out))
    return samples


async def _count_tokens(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> int:
    resp = await client.post(url, json={"model": model, "prompt": prompt})
    resp.raise_for_status()
    body = resp.json()
    return int(body["count"]) if "count" in body else len(body["tokens"])


async def align_prompts(
    client: httpx.AsyncClient, base_url: str, model: str, samples: list[SampleRequest], target_len: int | None = None
) -> list[SampleRequest]:
    """Best effort: make each synthetic prompt exactly `target_len` tokens by the server's count (None: each
    sample's own ``prompt_len``, the length it was drawn with).

    Words are appended/removed (at most 8 rounds per prompt); the server's final count becomes
    ``prompt_len`` (exact). If /tokenize is unavailable the samples are returned unchanged.
    """
    url = base_url.rstrip("/") + "/tokenize"
    out: list[SampleRequest] = []
    rng = random.Random(target_len or 0)
    try:
        for s in samples:
            target = s.prompt_len if target_len is None else target_len
            words = s.prompt.split()
            count = await _count_tokens(client, url, model, s.prompt)
            for _ in range(8):
                if count == target:
                    break
                if count > target:
                    words = words[: max(1, len(words) - (count - target))]
                else:
                    words += [rng.choice(WORDS) for _ in range(target - count)]
                count = await _count_tokens(client, url, model, " ".join(words))
            out.append(replace(s, prompt=" ".join(words), prompt_len=count, prompt_len_exact=True))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        print(f"WARNING: prompt alignment via {url} unavailable ({exc!r}); using word-count estimates")
        return samples
    return out
