"""`tokenloom lab`: run one workload through the batching modes (and policies) and write a report.

    tokenloom lab --workload mixed|uniform|long-prompt [--num-prompts N] [--batch-size B]
                  [--max-wait-ms MS] [--policies fcfs,sjf,priority]
                  [--modes static,dynamic,continuous]
                  [MODEL] [--dtype ...] [--quantization ...] [--kv-cache-dtype ...]  (serve's forward flags)
                  --out DIR

The model is loaded once, on the forward path `tokenloom serve` runs unless told otherwise (the same
flags and defaults: `config.FORWARD_PATH_FIELDS`, `SERVING_FORWARD_DEFAULTS`); the report names it with
the forward plan's line. Each mode x policy gets its own engine with max_num_seqs = B, and the runs
are interleaved step by step (see `driver`), with a progress line per run on stderr every few seconds.
Workloads are `tokenloom.bench.workload`'s. Writes DIR/report.md, DIR/*.png, DIR/trace.json,
DIR/summary.json and DIR/replay.json.gz (dashboard snapshots: `tokenloom dashboard-replay DIR`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING

from ..bench.workload import WORKLOADS, WorkloadRequest, make_workload
from ..config import FORWARD_PATH_FIELDS, SERVING_FORWARD_DEFAULTS, add_engine_args, forward_path_from_args
from ..engine.snapshot_recording import DEFAULT_MAX_FRAMES
from .progress import DEFAULT_INTERVAL_S, LabProgress

if TYPE_CHECKING:
    from .driver import LabResult, LabRun

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
    lab = subparsers.add_parser("lab")
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
    lab.add_argument("--max-num-batched-tokens", type=int, default=512)
    lab.add_argument("--progress-interval", type=float, default=DEFAULT_INTERVAL_S,
                     help="seconds between progress lines on stderr (0: none)")
    lab.add_argument("--replay-max-frames", type=int, default=DEFAULT_MAX_FRAMES,
                     help="dashboard snapshots kept per run in DIR/replay.json.gz (evenly spaced in steps; "
                          "0: no replay file)")
    lab.add_argument("--out", required=True, help="output directory")
    # The forward path as `tokenloom serve` takes it, with serve's defaults (--quantization auto): the
    # lab's figures then describe what a server runs; --quantization none is the exact float32 path.
    add_engine_args(lab, only=FORWARD_PATH_FIELDS)
    lab.set_defaults(func=cmd_lab, **SERVING_FORWARD_DEFAULTS)
    return lab


def load_real_model(model: str | None = None, dtype: str = "float32", quantization: str | None = None,
                    kv_cache_dtype: str = "auto", device: str = "cpu", num_threads: int | None = None):
    """Load weights and tokenizer once, for every engine of a lab run (`FORWARD_PATH_FIELDS` as keywords)."""
    from ..model.load import load, set_num_threads

    set_num_threads(num_threads)
    return load(model, dtype, device, quantization, kv_cache_dtype)[:2]


def run_all(model, tokenizer, requests: list[WorkloadRequest], runs: list[LabRun], log=print,
            progress: LabProgress | None = None, max_frames: int | None = None, **engine_kwargs):
    """Warm up, then run every configuration interleaved step by step (see `driver`)."""
    from .driver import run_workloads, warm_up

    for size in sorted({run.batch_size for run in runs}):
        warm_up(model, tokenizer, size, **engine_kwargs)
    t = time.perf_counter()
    results: list[LabResult] = run_workloads(model, tokenizer, requests, runs, progress=progress,
                                             max_frames=max_frames, **engine_kwargs)
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


def _model_name(source: str | None) -> str:
    from ..model.load import model_path

    return os.path.basename(model_path(source)).removesuffix(".gguf")


def cmd_lab(args: argparse.Namespace) -> int:
    from ..model import catalog
    from ..model.plan import plan_line
    from .driver import LabRun
    from .output import write_lab_outputs

    if args.replay_max_frames and args.replay_max_frames < 2:
        raise ValueError(f"--replay-max-frames: 0 (no replay) or at least 2, got {args.replay_max_frames}")
    if args.progress_interval < 0:
        raise ValueError(f"--progress-interval: must be >= 0, got {args.progress_interval}")
    requests = make_workload(args.workload, args.num_prompts, seed=args.seed, request_rate=args.request_rate)
    runs = [LabRun(mode, args.batch_size, policy, args.max_wait_ms) for policy in args.policies for mode in args.modes]
    forward = forward_path_from_args(args)
    catalog.pull_missing(forward["model"])
    engine_forward = {k: v for k, v in forward.items() if k != "model"}  # the model object is passed in
    print(f"loading model; {len(runs)} runs of {len(requests)} {args.workload} requests", flush=True)
    model, tokenizer = load_real_model(**forward)
    plan = plan_line(model)
    print(plan, flush=True)
    progress = LabProgress(args.progress_interval) if args.progress_interval else None
    results = run_all(
        model,
        tokenizer,
        requests,
        runs,
        lambda m: print(m, flush=True),
        progress=progress,
        max_frames=args.replay_max_frames or None,
        **engine_forward,
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
    report = write_lab_outputs(args.out, command, workload, requests, results, forward_plan=plan,
                               model_name=_model_name(forward["model"]))
    for c in report.get("comparisons", []):
        print(
            f"continuous / {c['static']}: measured {c['measured_ratio']:.2f}x, ideal {c['ideal_ratio']:.2f}x "
            f"({c['fraction_of_ideal']:.0%} of ideal)"
        )
    print(f"wrote {os.path.join(args.out, 'report.md')}")
    return 0
