"""Sweeps of the simulated fleet and what they report: one JSON-ready record per run, a markdown table,
the PNG plots (`fleet_plots`), and the check of a simulated run against a measured one.

A run is one (routing policy, request rate) over the shared-prefix workload (`shared_prefix_workload`);
every run of a sweep replays the same requests (same seed) at its own rate, so policies are compared on
identical arrivals. A record is the run's `FleetResult.summary()` plus the request rate, its TTFT
quantiles (for the CDF plot) and its workload.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..bench.arrivals import arrival_times
from ..bench.datasets import load_samples
from ..bench.workload import WorkloadRequest, shared_prefix_workload
from ..config import EngineConfig
from .cost_model import CostModel
from .fleet import Disaggregation, FleetResult, simulate_fleet

TTFT_QUANTILES = tuple(np.linspace(0, 100, 101))
TOLERANCE = 0.15  # the bar for simulated vs measured hit rate and TTFT


@dataclass(frozen=True)
class SharedPrefixSpec:
    """The shared-prefix workload, minus its rate (each run sets its own)."""

    num_prompts: int = 1000
    shared_prefixes: int = 8
    prefix_len: int = 512
    suffix_len: int = 64
    output_len: int | tuple[int, ...] = 128  # one length, or one per request
    burstiness: float = 1.0
    seed: int = 0

    def workload(self, request_rate: float):
        outs = self.output_len if isinstance(self.output_len, int) else list(self.output_len)
        return shared_prefix_workload(self.num_prompts, self.shared_prefixes, self.prefix_len, self.suffix_len,
                                      outs, request_rate, self.burstiness, self.seed)

    def describe(self) -> dict:
        d = asdict(self)
        if not isinstance(self.output_len, int):
            d["output_len"] = {"mean": float(np.mean(self.output_len)), "min": min(self.output_len),
                               "max": max(self.output_len)}
        return d


def run_record(rate: float, result: FleetResult) -> dict:
    ttfts = [r.ttft * 1000 for r in result.requests]
    return {"request_rate": rate, **result.summary(),
            "ttft_quantiles_ms": [float(q) for q in np.percentile(ttfts, TTFT_QUANTILES)]}


def sweep(cost_model: CostModel, spec: SharedPrefixSpec, policies: Sequence[str], rates: Sequence[float],
          num_replicas: int, config: EngineConfig | None = None, disaggregation: Disaggregation | None = None,
          slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, warmup_s: float = 0.0,
          tokenizer=None, progress=None) -> list[dict]:
    """One record per (policy, rate), policies outermost."""
    records = []
    for policy in policies:
        for rate in rates:
            result = simulate_fleet(cost_model, spec.workload(rate), num_replicas, policy, config,
                                    tokenizer=tokenizer, disaggregation=disaggregation,
                                    slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, warmup_s=warmup_s)
            records.append(run_record(rate, result))
            if progress is not None:
                progress(records[-1])
    return records


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(records: Sequence[dict]) -> str:
    head = ("| policy | rate (req/s) | throughput (req/s) | goodput (req/s) | in SLO | hit rate | "
            "TTFT mean / p99 (ms) | TPOT mean / p99 (ms) | queue mean / p99 (ms) | requests per replica max/mean |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        lines.append(
            f"| {r['policy']} | {_fmt(r['request_rate'], 0)} | {_fmt(r['request_throughput'])} | {_fmt(r['goodput'])} "
            f"| {_fmt(r['goodput_fraction'] and 100 * r['goodput_fraction'], 0)}% | {r['prefix_hit_rate']:.3f} "
            f"| {_fmt(r['mean_ttft_ms'])} / {_fmt(r['p99_ttft_ms'])} | {_fmt(r['mean_tpot_ms'], 2)} / "
            f"{_fmt(r['p99_tpot_ms'], 2)} | {_fmt(r['mean_queue_ms'])} / {_fmt(r['p99_queue_ms'])} "
            f"| {r['load_spread']['max_over_mean']:.2f} |")
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, header: dict, records: list[dict], name: str = "fleet_sim") -> list[Path]:
    """`name`.json (header + records), `name`.md (the table) and the plots; returns the paths written."""
    from .fleet_plots import write_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps({**header, "runs": records}, indent=2, default=str) + "\n")
    md_path.write_text(markdown_table(records))
    return [json_path, md_path, *write_plots(records, out, name)]


def dataset_workload(path: str, num_prompts: int, request_rate: float, burstiness: float = 1.0, seed: int = 0,
                     tokenizer=None) -> list[WorkloadRequest]:
    """The requests `tokenloom bench serve --dataset PATH.jsonl` sends, as the server sees them: the same
    samples (cycled to `num_prompts`, their max_tokens), each prompt tokenized as the completions
    endpoint tokenizes it, at the same arrival times (same seed)."""
    if tokenizer is None:
        from ..model.loader import bundled_model_path
        from ..model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(bundled_model_path())
    samples = load_samples(path, num_prompts, seed=seed)
    times = arrival_times(len(samples), request_rate, burstiness, seed)
    width = len(str(len(samples) - 1))
    return [WorkloadRequest(f"r{i:0{width}d}", tokenizer.encode(s.prompt), s.max_tokens, t)
            for i, (s, t) in enumerate(zip(samples, times, strict=True))]


def compare_with_real(real_hit_rate: float, real_ttft_ms: float, simulated: FleetResult | dict,
                      tolerance: float = TOLERANCE, ttft_stat: str = "median") -> dict:
    """The simulated run's prefix-cache hit rate and TTFT (`ttft_stat`: mean, median, p90 or p99) beside a
    measured run's on the same workload, with the relative differences and whether each is within
    `tolerance` (the issue's 15%). Prints one line per metric and returns the same as a dict."""
    summary = simulated.summary() if isinstance(simulated, FleetResult) else simulated
    ttft_key = f"{ttft_stat}_ttft_ms"
    rows = {"prefix_hit_rate": (real_hit_rate, summary["prefix_hit_rate"]),
            ttft_key: (real_ttft_ms, summary[ttft_key])}
    report = {}
    for metric, (real, sim) in rows.items():
        rel = abs(sim - real) / abs(real) if real else math.inf
        report[metric] = {"real": real, "simulated": sim, "relative_difference": rel, "within": rel <= tolerance}
        print(f"{metric:<16} real {real:10.3f}  simulated {sim:10.3f}  diff {100 * rel:5.1f}%  "
              f"{'ok' if rel <= tolerance else 'OFF'} (tolerance {100 * tolerance:.0f}%)")
    return report


def check_against_real(real_hit_rate: float, real_ttft_ms: float, cost_model: CostModel,
                       workload: list[WorkloadRequest], num_replicas: int = 2, policy: str = "prefix-aware",
                       config: EngineConfig | None = None, ttft_stat: str = "median",
                       tolerance: float = TOLERANCE, serving_path_s: float = 0.0) -> dict:
    """Simulate the measured run's setup (its requests — `dataset_workload` or `SharedPrefixSpec` — replica
    count, policy and engine knobs; `serving_path_s` as simulate_fleet's) and print its hit rate and TTFT
    beside the measured ones."""
    result = simulate_fleet(cost_model, workload, num_replicas, policy, config, serving_path_s=serving_path_s)
    prompt = sum(len(r.prompt_token_ids) for r in workload) / len(workload)
    print(f"simulated {num_replicas} replicas, {policy}, {len(workload)} requests (mean prompt {prompt:.0f} "
          f"tokens) over {workload[-1].arrival_time:.1f} s, cost model {cost_model.kind}")
    return compare_with_real(real_hit_rate, real_ttft_ms, result, tolerance, ttft_stat)
