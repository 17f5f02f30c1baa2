"""`tokenloom lab`: run one workload through the batching modes (and policies) and write a report.

    tokenloom lab --workload mixed|uniform|long-prompt [--num-prompts N] [--batch-size B]
                  [--max-wait-ms MS] [--policies fcfs,sjf,priority]
                  [--modes static,dynamic,continuous]
                  --out DIR

The model is loaded once; each mode x policy gets its own engine with max_num_seqs = B, and the runs
are interleaved step by step (see `driver`). Workloads are `tokenloom.bench.workload`'s. Writes
DIR/report.md, DIR/*.png, DIR/trace.json and DIR/summary.json.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from ..bench.workload import WORKLOADS, WorkloadRequest, make_workload
from .driver import LabResult, LabRun, run_workloads, warm_up

MODES = ("static", "dynamic", "continuous")
POLICIES = ("fcfs", "sjf", "priority")


def _csv(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (got {text!r})")
        return items

    return parse


def add_lab_parser(subparsers) -> argparse.ArgumentParser:
    lab = subparsers.add_parser("lab", help="compare static, dynamic and continuous batching on one workload")
    lab.add_argument("--workload", choices=WORKLOADS, default="mixed")
    lab.add_argument("--num-prompts", type=int, default=64)
    lab.add_argument("--batch-size", type=int, default=8, help="B: static batch size and max_num_seqs")
    lab.add_argument("--max-wait-ms", type=float, default=50.0, help="dynamic batching wait")
    lab.add_argument(
        "--policies", type=_csv(POLICIES), default=["fcfs"], help="comma list of fcfs,sjf,priority"
    )
    lab.add_argument("--modes", type=_csv(MODES), default=list(MODES), help="comma list of batching modes")
    lab.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals (req/s); default all at t=0"
    )
    lab.add_argument("--seed", type=int, default=0)
    lab.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2-135M)"
    )
    lab.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    lab.add_argument("--max-num-batched-tokens", type=int, default=512)
    lab.add_argument("--out", required=True, help="output directory")
    lab.set_defaults(func=cmd_lab)
    return lab


def load_real_model(model: str | None = None, dtype: str = "float32", quantization: str | None = None):
    """Load weights and tokenizer once, for every engine of a lab run."""
    from ..model.load import load

    return load(model, dtype, quantization=quantization)[:2]


def run_all(model, tokenizer, requests: list[WorkloadRequest], runs: list[LabRun], log=print, **engine_kwargs):
    """Warm up, then run every configuration interleaved step by step (see `driver`)."""
    for size in sorted({run.batch_size for run in runs}):
        warm_up(model, tokenizer, size, **engine_kwargs)
    t = time.perf_counter()
    results: list[LabResult] = run_workloads(model, tokenizer, requests, runs, **engine_kwargs)
    log(
        f"  {len(runs)} runs interleaved in {time.perf_counter() - t:.1f} s: "
        + ", ".join(f"{r.label} {len(r.steps)} steps / {r.wall_time:.1f} s" for r in results)
    )
    return results


def lab_command(args: argparse.Namespace) -> str:
    """The command line as typed (after `lab`), or a reconstruction when called from Python."""
    if getattr(args, "command_line", None):
        return args.command_line
    argv = sys.argv[sys.argv.index("lab") + 1 :] if "lab" in sys.argv else []
    if not argv:
        argv = ["--workload", args.workload, "--out", args.out]
    return "tokenloom lab " + shlex.join(argv)


def cmd_lab(args: argparse.Namespace) -> int:
    from .output import write_lab_outputs

    requests = make_workload(args.workload, args.num_prompts, seed=args.seed, request_rate=args.request_rate)
    runs = [LabRun(mode, args.batch_size, policy, args.max_wait_ms) for policy in args.policies for mode in args.modes]
    print(f"loading model; {len(runs)} runs of {len(requests)} {args.workload} requests", flush=True)
    model, tokenizer = load_real_model(args.model, args.dtype)
    results = run_all(
        model,
        tokenizer,
        requests,
        runs,
        lambda m: print(m, flush=True),
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    command = lab_command(args)
    workload = {
        "name": args.workload,
        "num_prompts": len(requests),
        "batch_size": args.batch_size,
        "output_tokens": sum(r.max_tokens for r in requests),
        "request_rate": args.request_rate or "all at t=0",
        "seed": args.seed,
    }
    report = write_lab_outputs(args.out, command, workload, requests, results)
    for c in report.get("comparisons", []):
        print(
            f"continuous / {c['static']}: measured {c['measured_ratio']:.2f}x, ideal {c['ideal_ratio']:.2f}x "
            f"({c['fraction_of_ideal']:.0%} of ideal)"
        )
    print(f"wrote {os.path.join(args.out, 'report.md')}")
    return 0
