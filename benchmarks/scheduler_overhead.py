"""Engine overhead per step on the real model with 32 running sequences (issue 4 acceptance).

    .venv/bin/python benchmarks/scheduler_overhead.py [--num-seqs 32] [--steps 40] [--quantization auto]

32 requests (a `uniform` workload: 32-token prompts, greedy, ignore_eos, all at t = 0; replayed by
`tokenloom.bench.replay`) are prefilled, a few decode steps warm up, then `--steps` steady-state decode
steps (every step: 32 sequences, 1 token each) are measured. Overhead
per step = StepStats.duration - StepStats.forward_time: scheduling, input preparation, sampling and
bookkeeping (appending tokens, detokenizing, stop checks, outputs). For a breakdown the benchmark also
times the scheduler's `schedule`, the runner's `_prepare` and `_sample` by wrapping them on this engine
instance (no engine change). Target: median overhead < 10% of the step, and on the fast path (`--quantization auto`, as serving runs
it) scheduling + input preparation < 5%. Writes benchmarks/results/scheduler_overhead[-auto].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tokenloom import EngineConfig
from tokenloom.bench.replay import replay
from tokenloom.bench.workload import make_workload
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.lab.cli import load_real_model
from tokenloom.lab.output import environment

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(obj, name: str, sink: dict[str, float]) -> None:
    """Replace obj.name by a wrapper adding its wall time to sink[name] (this instance only)."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink[name] = sink.get(name, 0.0) + time.perf_counter() - t

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quantization", default="none", help="none (the float32 reference path) or auto (serving's)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/scheduler_overhead[-QUANTIZATION]")
    args = ap.parse_args()
    fast = args.quantization != "none"
    args.out = args.out or os.path.join(HERE, "results", "scheduler_overhead" + (f"-{args.quantization}" if fast else ""))
    target = 0.10

    model, tokenizer = load_real_model(quantization=args.quantization)
    engine = LLMEngine(EngineConfig(max_num_seqs=args.num_seqs), model=model, tokenizer=tokenizer)
    max_tokens = args.warmup + args.steps + 8
    workload = make_workload("uniform", args.num_seqs, input_len=32, output_len=max_tokens)

    parts: dict[str, float] = {"schedule": 0.0, "_prepare": 0.0, "_sample": 0.0}
    timed(engine.scheduler, "schedule", parts)
    timed(engine.runner, "_prepare", parts)
    timed(engine.runner, "_sample", parts)
    rows = []
    state = {"before": dict(parts), "decode_steps": 0}

    def on_step() -> None:
        """Measure `--steps` steps after the first step in which every sequence decodes and `--warmup` more."""
        st, before = engine.last_step, state["before"]
        state["before"] = dict(parts)
        state["decode_steps"] += st.num_decode_tokens >= args.num_seqs
        if not args.warmup + 1 < state["decode_steps"] <= args.warmup + 1 + args.steps:
            return
        assert st.num_seqs == args.num_seqs and st.num_decode_tokens == args.num_seqs, st
        rows.append(
            {
                "step_ms": st.duration * 1e3,
                "forward_ms": st.forward_time * 1e3,
                **{f"{k.strip('_')}_ms": (parts[k] - before[k]) * 1e3 for k in parts},
            }
        )

    replay(engine, workload, on_step)

    for r in rows:
        r["overhead_ms"] = r["step_ms"] - r["forward_ms"]
        r["other_ms"] = r["overhead_ms"] - r["schedule_ms"] - r["prepare_ms"] - r["sample_ms"]
        r["overhead_frac"] = r["overhead_ms"] / r["step_ms"]
        r["schedule_prepare_frac"] = (r["schedule_ms"] + r["prepare_ms"]) / r["step_ms"]
    fracs = [r["overhead_frac"] for r in rows]
    keys = ("step_ms", "forward_ms", "overhead_ms", "schedule_ms", "prepare_ms", "sample_ms", "other_ms")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    mean = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    result = {
        "command": "python benchmarks/scheduler_overhead.py"
        + (f" --num-seqs {args.num_seqs}" if args.num_seqs != 32 else "")
        + (f" --steps {args.steps}" if args.steps != 40 else "")
        + (f" --quantization {args.quantization}" if fast else ""),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "environment": environment(),
        "num_running_seqs": args.num_seqs,
        "measured_steps": len(rows),
        "overhead_fraction": {
            "median": statistics.median(fracs),
            "mean": statistics.fmean(fracs),
            "max": max(fracs),
        },
        "median_ms": {k: round(v, 3) for k, v in med.items()},
        "mean_ms": {k: round(v, 3) for k, v in mean.items()},
        "schedule_prepare_fraction_median": statistics.median(r["schedule_prepare_frac"] for r in rows),
        "target": f"< {target:.0%} of the step; scheduling + preparation < 5%",
        "steps": [{k: round(v, 4) for k, v in r.items()} for r in rows],
    }
    of = result["overhead_fraction"]
    print(f"{args.num_seqs} running sequences, {len(rows)} decode steps")
    print(
        f"step {med['step_ms']:.1f} ms median, forward {med['forward_ms']:.1f} ms, overhead "
        f"{med['overhead_ms']:.2f} ms (schedule {med['schedule_ms']:.2f}, prepare {med['prepare_ms']:.2f}, "
        f"sample {med['sample_ms']:.2f}, other {med['other_ms']:.2f})"
    )
    print(
        f"overhead fraction: median {of['median']:.1%}, mean {of['mean']:.1%}, max {of['max']:.1%} "
        f"(target < {target:.0%}); scheduling + preparation {result['schedule_prepare_fraction_median']:.1%} (target < 5%)"
    )

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(
            "# Scheduler overhead at 32 running sequences\n\n"
            f"Command: `{result['command']}` ({result['date']}). {result['environment']}\n\n"
            f"{args.num_seqs} sequences in decode steady state (32-token prompts, greedy, ignore_eos), "
            f"{len(rows)} measured steps after {args.warmup} warm-up steps. Overhead = StepStats.duration - "
            "forward_time (scheduling, input preparation, sampling, bookkeeping).\n\n"
            f"**Overhead: median {of['median']:.1%}, mean {of['mean']:.1%} of the step** "
            f"(max {of['max']:.1%}; target < {target:.0%}); scheduling + input preparation "
            f"{result['schedule_prepare_fraction_median']:.1%} (target < 5%).\n\n| ms per step | median | mean |\n|---|---|---|\n"
            + "".join(f"| {k[:-3]} | {med[k]:.2f} | {mean[k]:.2f} |\n" for k in keys)
            + "\n`other` = appending tokens, detokenizing, stop checks, building outputs, step listeners.\n"
        )


if __name__ == "__main__":
    main()
