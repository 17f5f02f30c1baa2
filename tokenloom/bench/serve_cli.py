"""`tokenloom bench serve`: drive an OpenAI-compatible server and report vLLM-style serving metrics.

`add_bench_parser(subparsers)` registers ``bench`` -> ``serve`` (``func`` = `cmd_bench_serve`, which returns
an exit code); `run_bench_serve(args)` returns the result dict. It builds the
prompts (`datasets`), runs the load (`client`), aggregates (`metrics`), prints a summary table in the
layout of `vllm bench serve` and, with --out, writes a JSON with every metric, the run's config and the
per-request arrays (input_lens, output_lens, ttfts, itls, latencies, start_times, errors, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from datetime import datetime
from typing import Any

import httpx

from .client import LoadConfig, fetch_first_model, run_load
from .datasets import align_prompts, load_samples
from .serving_metrics import METRIC_NAMES, compute_metrics, per_request_arrays, percentile_key

PERCENTILES = (50, 90, 99)
HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench serve` on a top-level subparsers object; returns the `serve` parser."""
    bench = subparsers.add_parser("bench", help="benchmarks (serve: load-test an OpenAI-compatible server)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("serve", help="load-test a running server, report TTFT/TPOT/ITL/E2EL/goodput")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--model", default=None, help="model name (default: first id from GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dataset", default="random", help="random | mixed | PATH.jsonl")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens (random/mixed)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens for the 'fixed' distribution")
    p.add_argument(
        "--output-len-dist",
        default=None,
        help="fixed | uniform:a,b | mixed:short,long (default: fixed; mixed:16,256 for --dataset mixed; "
        "the file's max_tokens for .jsonl)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT (ms)")
    p.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput SLO on E2EL (ms)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument(
        "--no-align-prompts", action="store_true", help="skip exact-length alignment via /tokenize"
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request total timeout (s)")
    p.add_argument("--run-timeout", type=float, default=None, help="whole-run deadline (s)")
    p.set_defaults(func=cmd_bench_serve)
    return p


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """CLI entry (`args.func`): exit code 0 if any request succeeded, else 1."""
    return 0 if run_bench_serve(args)["completed"] > 0 else 1


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


async def _prepare(args: argparse.Namespace) -> tuple[str, list]:
    model = args.model or await fetch_first_model(args.base_url, args.api_key)
    samples = load_samples(
        args.dataset, args.num_prompts, args.input_len, args.output_len, args.output_len_dist, args.seed
    )
    if args.dataset in ("random", "mixed") and not args.no_align_prompts:
        async with httpx.AsyncClient(timeout=30.0) as client:
            samples = await align_prompts(client, args.base_url, model, samples, args.input_len)
    return model, samples


def run_bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args`; prints the summary, writes --out, returns the result."""
    model, samples = asyncio.run(_prepare(args))
    cfg = LoadConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        api_key=args.api_key,
        ignore_eos=not args.no_ignore_eos,
        request_timeout_s=args.request_timeout,
        run_timeout_s=args.run_timeout,
        show_progress=not args.no_progress,
    )
    dist = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(
        f"Traffic request rate: {args.request_rate}; burstiness {args.burstiness} ({dist}); "
        f"max concurrency: {args.max_concurrency}"
    )
    results, duration = asyncio.run(run_load(cfg, samples))
    metrics = compute_metrics(
        results, duration, args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms, PERCENTILES
    )
    config = {
        k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not k.endswith("_command")
    }
    config.update(model=model, percentiles=list(PERCENTILES))
    result: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "model_id": model,
        "endpoint": args.endpoint,
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
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(_json_safe(result), f, indent=2)
        print(f"wrote {args.out}")
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
