"""Serving-benchmark metrics, defined exactly as `vllm bench serve` defines them (pure functions).

Per request (all client-side, seconds, measured with `time.perf_counter()`):
- ``start_time``: just before the POST is sent (after any client-side concurrency wait).
- ``ttft``: arrival of the first SSE ``data:`` message carrying ``choices`` (its text may be empty) - start.
- ``itl``: gaps between consecutive choice-bearing messages (per *message*, not per token: a bundle of
  tokens in one message yields one gap). ITL statistics pool every gap of every successful request.
- ``latency`` (E2EL): arrival of the last choice-bearing message - start (usage-only messages excluded).
- ``output_tokens``: ``usage.completion_tokens`` (the client fills in a fallback when usage is absent).

Aggregates (`compute_metrics`), over successful requests only; failures are counted, never averaged:
- TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with > 1 output token; requests with
  <= 1 token are left out of TPOT statistics but count as TPOT 0 when judging goodput.
- mean / median / std (population, numpy default) / p-th percentiles (numpy linear interpolation), in ms,
  for TTFT, TPOT, ITL, E2EL; an empty list gives 0 (as vLLM's ``np.mean(x or 0)``).
- request_throughput = completed / duration; output_throughput = output tokens / duration;
  total_token_throughput = (input + output tokens) / duration.
- request_goodput = requests meeting every given SLO (metric <= SLO ms) / duration; None without SLOs.
  `slo_attained` counts the successful requests that met TTFT, TPOT and all of them ("both"), judged by
  `tokenloom.slo.SLO.attained`, the server's own definition (its `slo_attained_total` counters).
- max_output_tokens_per_s: peak over 1-s buckets from the first start; each choice-bearing message
  (first at start + ttft, then + each itl) counts one token, as in vLLM.
- max_concurrent_requests: exact peak of overlapping [start, start + latency) intervals (sweep line,
  departures before arrivals at equal times).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..slo import ATTAINMENT_KINDS, SLO

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """Outcome of one benchmark request (times in seconds)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    usage_reported: bool = False  # False: output_tokens is the client's fallback count


@dataclass
class BenchmarkMetrics:
    """Aggregate metrics; `to_dict()` gives vLLM's result-json key names (``p99_ttft_ms``, ...)."""

    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latency_stats: dict[str, float]  # mean_/median_/std_/pNN_ {ttft,tpot,itl,e2el} _ms
    output_lens: list[int]  # per request, 0 for failures (vLLM's actual_output_lens)
    slo_attained: dict[str, int] | None = None  # {"ttft", "tpot", "both"}: requests that met them (None: no SLO)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("output_lens")
        out.update(out.pop("latency_stats"))
        return out

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]


def percentile_key(p: float, name: str) -> str:
    """vLLM's key for a percentile: 99 -> ``p99_ttft_ms``, 99.9 -> ``p99.9_ttft_ms``."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{name}_ms"


def summarize(values: Sequence[float], name: str, percentiles: Iterable[float]) -> dict[str, float]:
    """mean/median/std/percentiles of `values` (seconds) in ms; an empty list summarises as 0."""
    data = list(values) or [0.0]
    stats = {
        f"mean_{name}_ms": float(np.mean(data)) * 1000,
        f"median_{name}_ms": float(np.median(data)) * 1000,
        f"std_{name}_ms": float(np.std(data)) * 1000,
    }
    for p in percentiles:
        stats[percentile_key(p, name)] = float(np.percentile(data, p)) * 1000
    return stats


def request_tpot(r: RequestResult) -> float | None:
    """TPOT of one successful request, or None when it has <= 1 output token."""
    if r.output_tokens > 1:
        return (r.latency - r.ttft) / (r.output_tokens - 1)
    return None


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Peak number of overlapping half-open intervals [start, end)."""
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, -1))
    events.sort()  # at equal times -1 sorts before +1: a departure frees its slot first
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def peak_output_tokens_per_s(ok: Sequence[RequestResult]) -> float:
    """Max count of choice-bearing messages in any 1-s bucket measured from the earliest start."""
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    t_end = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(math.ceil(t_end - t0) + 1)
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for t in times:
            b = int(t - t0)
            if 0 <= b < len(buckets):
                buckets[b] += 1
    return float(buckets.max())


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2el_ms: float | None = None,
    percentiles: Iterable[float] = (50, 90, 99),
) -> BenchmarkMetrics:
    """Aggregate per-request results of a run that lasted `duration` seconds (see module docstring)."""
    if duration <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration}")
    percentiles = tuple(percentiles)
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots = [t for t in map(request_tpot, ok) if t is not None]
    output_lens = [r.output_tokens if r.success else 0 for r in results]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(output_lens)

    slo = SLO(slo_ttft_ms, slo_tpot_ms, slo_e2el_ms)
    goodput: float | None = None
    attained: dict[str, int] | None = None
    if not slo.empty:
        met = [slo.attained(r.ttft, request_tpot(r), r.latency) for r in ok]
        attained = {kind: sum(m[kind] for m in met) for kind in ATTAINMENT_KINDS}
        goodput = attained["both"] / duration

    stats: dict[str, float] = {}
    for name, values in zip(METRIC_NAMES, (ttfts, tpots, itls, e2els), strict=True):
        stats.update(summarize(values, name, percentiles))

    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        request_goodput=goodput,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=peak_output_tokens_per_s(ok),
        max_concurrent_requests=peak_concurrency((r.start_time, r.start_time + r.latency) for r in ok),
        latency_stats=stats,
        output_lens=output_lens,
        slo_attained=attained,
    )


def per_request_arrays(results: Sequence[RequestResult], output_lens: Sequence[int]) -> dict[str, list]:
    """vLLM result-json per-request arrays, in request order (failures included)."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": list(output_lens),
        "ttfts": [r.ttft for r in results],
        "itls": [list(r.itl) for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
