"""`tokenloom bench serve`: drive an OpenAI-compatible server and report vLLM-style serving metrics.

`add_bench_parser(subparsers)` registers ``bench`` -> ``serve`` (``func`` = `cmd_bench_serve`, which returns
an exit code); the flags, in our spelling or `vllm bench serve`'s, resolve to one `BenchServeConfig`
(`serve_args`); `run_bench_serve(config)` returns the result dict. It builds the
prompts (`datasets`), runs the load (`client`), aggregates (`metrics`), prints a summary table in the
layout of `vllm bench serve` and, with --out or --save-result, writes a JSON with every metric, the run's config and the
per-request arrays (input_lens, output_lens, ttfts, itls, latencies, start_times, errors, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
from datetime import datetime
from typing import Any

import httpx

from .client import LoadConfig, fetch_first_model, run_load
from .datasets import align_prompts, load_samples
from .serve_args import BenchServeConfig, add_bench_serve_args, bench_config_from_args
from .serving_metrics import METRIC_NAMES, compute_metrics, per_request_arrays, percentile_key

HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench serve` on a top-level subparsers object; returns the `serve` parser."""
    bench = subparsers.add_parser("bench")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("serve", help="load-test a running server, report TTFT/TPOT/ITL/E2EL/goodput",
                             description="Load-test an OpenAI-compatible server. Takes `vllm bench serve`'s "
                                         "flag names too (see tokenloom/bench/serve_args.py).")
    add_bench_serve_args(p)
    p.set_defaults(func=cmd_bench_serve)
    return p


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """CLI entry (`args.func`): exit code 0 if any request succeeded, else 1."""
    return 0 if run_bench_serve(bench_config_from_args(args))["completed"] > 0 else 1


def _line(label: str, value: Any, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def format_summary(result: dict[str, Any]) -> str:
    """vLLM-like plain-text summary of a result dict from `run_bench_serve`."""
    cfg = result["config"]
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines.append(_line("Successful requests:", result["completed"]))
    lines.append(_line("Failed requests:", result["failed"]))
    if cfg["max_concurrency"] is not None:
        lines.append(_line("Maximum request concurrency:", cfg["max_concurrency"]))
    if not math.isinf(cfg["request_rate"]):
        lines.append(_line("Request rate configured (RPS):", cfg["request_rate"], ".2f"))
    lines.append(_line("Benchmark duration (s):", result["duration"], ".2f"))
    lines.append(_line("Total input tokens:", result["total_input_tokens"]))
    lines.append(_line("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_line("Request throughput (req/s):", result["request_throughput"], ".2f"))
    if result["request_goodput"] is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"], ".2f"))
        met, n = result.get("slo_attained"), result["completed"] + result["failed"]
        if met and n:  # failures count as misses, as the server counts a request it refused under --slo-shed
            lines.append(_line("SLO attained ttft/tpot/both (%):",
                               " / ".join(f"{100 * met[k] / n:.1f}" for k in ("ttft", "tpot", "both"))))
    lines.append(_line("Output token throughput (tok/s):", result["output_throughput"], ".2f"))
    lines.append(_line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f"))
    lines.append(_line("Peak concurrent requests:", result["max_concurrent_requests"], ".2f"))
    lines.append(_line("Total token throughput (tok/s):", result["total_token_throughput"], ".2f"))
    for name in METRIC_NAMES:
        short, header = HEADERS[name]
        lines.append(f"{header:-^50}")
        lines.append(_line(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f"))
        lines.append(_line(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f"))
        for p in result["config"]["percentiles"]:
            key = percentile_key(p, name)
            lines.append(_line(f"{key.split('_')[0].upper()} {short} (ms):", result[key], ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)


async def _prepare(cfg: BenchServeConfig) -> tuple[str, list]:
    model = cfg.model or await fetch_first_model(cfg.base_url, cfg.api_key)
    samples = load_samples(
        cfg.dataset, cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.output_len_dist, cfg.seed, cfg.range_ratio
    )
    if cfg.dataset in ("random", "mixed") and cfg.align_prompts:
        async with httpx.AsyncClient(timeout=30.0) as client:
            samples = await align_prompts(client, cfg.base_url, model, samples)
    return model, samples


def run_bench_serve(cfg: BenchServeConfig | argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark `cfg` describes (parsed flags are resolved first); prints the summary, writes the
    result file (--out or --save-result), returns the result."""
    if isinstance(cfg, argparse.Namespace):
        cfg = bench_config_from_args(cfg)
    model, samples = asyncio.run(_prepare(cfg))
    load = LoadConfig(
        base_url=cfg.base_url,
        model=model,
        endpoint=cfg.endpoint,
        request_rate=cfg.request_rate,
        burstiness=cfg.burstiness,
        max_concurrency=cfg.max_concurrency,
        seed=cfg.seed,
        api_key=cfg.api_key,
        ignore_eos=cfg.ignore_eos,
        request_timeout_s=cfg.request_timeout,
        run_timeout_s=cfg.run_timeout,
        show_progress=cfg.progress,
    )
    dist = "Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution"
    print(
        f"Traffic request rate: {cfg.request_rate}; burstiness {cfg.burstiness} ({dist}); "
        f"max concurrency: {cfg.max_concurrency}"
    )
    started = datetime.now()
    results, duration = asyncio.run(run_load(load, samples))
    metrics = compute_metrics(
        results, duration, cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.slo_e2el_ms, cfg.percentiles
    )
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
    config.update(model=model, percentiles=list(cfg.percentiles))
    result: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "model_id": model,
        "endpoint": cfg.endpoint,
        "config": config,
        "duration": duration,
        **metrics.to_dict(),
        "usage_reported": all(r.usage_reported for r in results if r.success),
        **per_request_arrays(results, metrics.output_lens),
    }
    failures = [r.error for r in results if not r.success]
    for i, err in enumerate(failures[:10]):
        print(f"Error {i}: {err}")
    print(format_summary(result))
    out = cfg.result_path(model, started.strftime("%Y%m%d-%H%M%S"))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(_json_safe(result), f, indent=2)
        print(f"wrote {out}")
    return result


def _json_safe(obj: Any) -> Any:
    """inf/nan are not JSON: write them as strings ("inf")."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj
