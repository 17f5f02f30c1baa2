"""`tokenloom simulate` and `tokenloom calibrate` (registered into the main parser by `tokenloom.cli`).

    tokenloom calibrate --out calibration.json [--quick] [engine knobs]
    tokenloom calibrate --out calibration.json --from-steps steps-*.jsonl   (a server's --record-steps)
    tokenloom simulate (--cost-model calibration.json | --preset llama-3-8b@h100) --workload poisson \
        --num-prompts 200 --request-rate 8 --input-len 512 --output-len 128 [engine knobs] [--json]
        [--slo-ttft-ms 1000 --slo-tpot-ms 100 --scheduling-policy slo --fairness vtc --slo-shed]

With SLO flags every request gets those targets, and the report adds their attainment (TTFT, TPOT, both)
and the goodput, counted as the server counts them (`tokenloom.slo.Attainment`); the policies are the
engine's own scheduler code.

With a preset, the simulated engine keeps KV in bfloat16 and, unless --kv-cache-memory-bytes or
--num-kv-blocks is given, gets 90% of the GPUs' memory minus the weights for the KV cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from ..bench.workload import WORKLOADS, make_workload
from ..config import DEFAULT_KV_CACHE_MEMORY_BYTES
from ..engine.snapshot_recording import DEFAULT_MAX_FRAMES


def fit_preset(config, cost) -> None:
    """A roofline preset's engine: KV in bfloat16, and (unless sized by a flag) 90% of the GPUs' memory
    minus the weights for the KV cache."""
    config.dtype = "bfloat16"
    if config.num_kv_blocks is None and config.kv_cache_memory_bytes == DEFAULT_KV_CACHE_MEMORY_BYTES:
        config.kv_cache_memory_bytes = cost.kv_memory_bytes()


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..config import engine_config_from_args
    from ..slo import SLO, slo_number
    from .cost_model import MODELS, load_cost_model, preset
    from .simulator import simulate

    if (args.cost_model is None) == (args.preset is None):
        raise ValueError("simulate: give exactly one of --cost-model PATH or --preset MODEL@GPU")
    cost = load_cost_model(args.cost_model) if args.cost_model else preset(args.preset)
    config = engine_config_from_args(args)
    model_config = None
    if args.sim_model:
        if args.sim_model not in MODELS:
            raise ValueError(f"sim_model: must be one of {', '.join(MODELS)}, got {args.sim_model!r}")
        model_config = MODELS[args.sim_model]
    if args.preset:
        fit_preset(config, cost)
    workload = make_workload(args.workload, args.num_prompts, args.input_len, args.output_len,
                             args.request_rate, args.workload_seed)
    slo = SLO(**{f"{k}_ms": slo_number(f"--slo-{k}-ms", v)
                 for k in ("ttft", "tpot", "e2e") if (v := getattr(args, f"slo_{k}_ms")) is not None})
    if not slo.empty:
        workload = [dataclasses.replace(r, slo=slo) for r in workload]
    if args.record_replay and args.replay_max_frames < 2:
        raise ValueError(f"--replay-max-frames: must be at least 2, got {args.replay_max_frames}")
    record_frames = args.replay_max_frames if args.record_replay else 0
    result = simulate(cost, workload, config, model_config, record_frames=record_frames)
    if result.snapshots is not None:
        from ..engine.snapshot_recording import write_replay

        meta = {"command": "tokenloom simulate", "model": f"simulated ({cost.kind}: {cost.source})",
                "plan": "", "workload": {"name": args.workload, "num_prompts": args.num_prompts}}
        path = write_replay(args.record_replay, [result.snapshots], meta)
        print(f"wrote {path} (tokenloom dashboard-replay {path})", file=sys.stderr)
    summary = result.summary()
    report = {
        "workload": args.workload, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "input_len": args.input_len, "output_len": args.output_len, "cost_model": cost.to_dict(),
        "engine": dataclasses.asdict(config), **summary,
    }
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"simulated {args.workload}: {args.num_prompts} requests, cost model {cost.kind} ({cost.source})")
    for key, value in summary.items():
        print(f"  {key:<20} {value:12.3f}")
    return 0


def add_simulate_parser(subparsers) -> None:
    from ..config import add_engine_args
    from .cost_model import MODELS, PRESETS

    p = subparsers.add_parser("simulate")
    p.add_argument("--cost-model", help="JSON written by `tokenloom calibrate`")
    p.add_argument("--preset", help=f"MODEL@GPU[xN] from published FLOPs/bandwidth: {', '.join(PRESETS)}")
    p.add_argument("--sim-model", help=f"model shape for KV sizing with --cost-model: {', '.join(MODELS)}")
    p.add_argument("--workload", choices=WORKLOADS, default="uniform")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at 0")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="every request's TTFT target (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="every request's TPOT target (ms)")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="every request's end-to-end target (ms)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--record-replay", metavar="FILE", default=None,
                   help="write the run's dashboard snapshots here (.json.gz; open with `tokenloom dashboard-replay`)")
    p.add_argument("--replay-max-frames", type=int, default=DEFAULT_MAX_FRAMES,
                   help="snapshots kept in --record-replay, evenly spaced in steps")
    add_engine_args(p)
    p.set_defaults(func=cmd_simulate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..engine.cost_model import fit_linear, with_spread
    from .cost_model import save_cost_model

    if args.from_steps:
        from ..engine.step_log import read_step_logs

        samples = read_step_logs(args.from_steps)
        model = with_spread(fit_linear(samples, source=f"tokenloom calibrate --from-steps: {len(samples)} served "
                                                        "steps"), samples)
        save_cost_model(model, args.out, {"from_steps": args.from_steps,
                                          "formula": "step_s = intercept + sum(coef[f] * feature f); features "
                                                     "in tokenloom/engine/cost_model.py"})
    else:
        from ..config import engine_config_from_args
        from ..engine.llm_engine import LLMEngine
        from .calibrate import calibrate, calibration_record

        engine = LLMEngine(engine_config_from_args(args))
        model, _ = calibrate(engine, quick=args.quick)
        save_cost_model(model, args.out, calibration_record(model, engine, args.quick))
    stats = model.fit_stats
    print(f"wrote {args.out}: intercept {model.intercept * 1000:.2f} ms, "
          + ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in model.coef.items()))
    print(f"fit over {stats['samples']} steps: r2 {stats['r2']:.3f}, median error "
          f"{stats['median_rel_error']:.1%}, p90 {stats['p90_rel_error']:.1%}")
    return 0


def add_calibrate_parser(subparsers) -> None:
    from ..config import SERVING_FORWARD_DEFAULTS, add_engine_args

    p = subparsers.add_parser("calibrate")
    p.add_argument("--out", default="calibration.json")
    p.add_argument("--quick", action="store_true", help="a smaller grid (about a third of the time)")
    p.add_argument("--from-steps", nargs="+", metavar="FILE", default=None,
                   help="fit on the steps a server recorded (`tokenloom serve --record-steps`) instead of "
                        "measuring the grid: the engine as it ran, on that machine under that load")
    add_engine_args(p)
    # The forward `tokenloom serve` runs (--quantization auto), so the fitted costs are a server's;
    # --quantization none measures the exact float32 path.
    p.set_defaults(func=cmd_calibrate, **SERVING_FORWARD_DEFAULTS)
