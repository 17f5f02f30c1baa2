"""`tokenloom simulate-fleet`: many simulated replicas behind a router, on the shared-prefix workload.

    tokenloom simulate-fleet --cost-model llama-3-8b@h100 --replicas 64 \
        --routing-policy round-robin least-loaded prefix-aware --request-rate 1000 2000 \
        --num-prompts 4000 --shared-prefixes 8 --prefix-len 1024 --suffix-len 128 --output-len 128 \
        --slo-ttft-ms 500 --slo-tpot-ms 50 [--disaggregate 16:48] [engine knobs] --out DIR

One run per (policy, rate), all on the same requests. Prints a table; `--out DIR` writes
fleet_sim.json, fleet_sim.md and the plots (goodput vs rate, hit rate, TTFT CDF). `--cost-model` takes a
file from `tokenloom calibrate` or a roofline preset MODEL@GPU[xN] (its engine as `tokenloom simulate
--preset` builds it). A separate command rather than flags on `simulate`: its workload, sweep and
report are its own, and `simulate` stays the one-engine tool.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..fleet.routing import POLICIES


def load_cost(spec: str):
    """A calibration file, or a preset name."""
    from .cost_model import PRESETS, load_cost_model, preset

    if Path(spec).is_file():
        return load_cost_model(spec)
    if "@" not in spec:
        raise ValueError(f"--cost-model: {spec!r} is neither a file nor a preset (MODEL@GPU[xN]: {', '.join(PRESETS)})")
    try:
        return preset(spec)
    except ValueError as exc:
        raise ValueError(f"--cost-model: {exc}") from None


def _check(args: argparse.Namespace) -> None:
    """Bad values, each named by its flag."""
    positive = {"--replicas": args.replicas, "--num-prompts": args.num_prompts,
                "--shared-prefixes": args.shared_prefixes, "--output-len": args.output_len,
                "--kv-transfer-gbps": args.kv_transfer_gbps}
    for flag, value in positive.items():
        if not value > 0:
            raise ValueError(f"{flag}: must be positive, got {value}")
    for flag, value in {"--prefix-len": args.prefix_len, "--suffix-len": args.suffix_len,
                        "--warmup-s": args.warmup_s}.items():
        if value < 0:
            raise ValueError(f"{flag}: must not be negative, got {value}")
    if any(not r > 0 for r in args.request_rate):
        raise ValueError(f"--request-rate: every rate must be positive (inf = all at once), got {args.request_rate}")
    for flag, value in {"--slo-ttft-ms": args.slo_ttft_ms, "--slo-tpot-ms": args.slo_tpot_ms}.items():
        if value is not None and not value > 0:
            raise ValueError(f"{flag}: must be positive, got {value}")


def cmd_simulate_fleet(args: argparse.Namespace) -> int:
    from ..bench.datasets import parse_output_len_dist
    from ..config import engine_config_from_args
    from .cli import fit_preset
    from .fleet import Disaggregation, parse_disaggregate
    from .fleet_report import SharedPrefixSpec, markdown_table, sweep, write_report

    _check(args)
    cost = load_cost(args.cost_model)
    config = engine_config_from_args(args)
    if cost.kind == "roofline":
        fit_preset(config, cost)
    disagg = None
    if args.disaggregate:
        try:
            p, d = parse_disaggregate(args.disaggregate)
            disagg = Disaggregation(p, d, args.kv_transfer_gbps * 1e9)
        except ValueError as exc:
            raise ValueError(f"--disaggregate: {str(exc).removeprefix('disaggregate: ')}") from None
    outs: int | tuple[int, ...] = args.output_len
    if args.output_len_dist:
        outs = tuple(parse_output_len_dist(args.output_len_dist, args.output_len, args.num_prompts, args.workload_seed + 1))
    spec = SharedPrefixSpec(args.num_prompts, args.shared_prefixes, args.prefix_len, args.suffix_len, outs,
                            args.burstiness, args.workload_seed)
    replicas = disagg.prefill + disagg.decode if disagg else args.replicas

    def progress(r: dict) -> None:
        print(f"  {r['policy']:<13} {r['request_rate']:>8g} req/s: goodput {r['goodput'] or 0:8.1f}  "
              f"hit rate {r['prefix_hit_rate']:.3f}  TTFT mean {r['mean_ttft_ms']:8.1f} ms", file=sys.stderr)

    records = sweep(cost, spec, args.routing_policy, args.request_rate, replicas, config, disagg,
                    args.slo_ttft_ms, args.slo_tpot_ms, args.warmup_s, progress=progress)
    header = {"replicas": replicas, "disaggregate": dataclasses.asdict(disagg) if disagg else None,
              "cost_model": cost.to_dict(), "engine": dataclasses.asdict(config), "workload": spec.describe(),
              "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "warmup_s": args.warmup_s}
    print(markdown_table(records), end="")
    if args.out:
        for path in write_report(args.out, header, records):
            print(f"wrote {path}")
    return 0


def add_simulate_fleet_parser(subparsers) -> None:
    from ..config import add_engine_args

    p = subparsers.add_parser("simulate-fleet")
    p.add_argument("--cost-model", required=True, help="a `tokenloom calibrate` JSON file, or a preset MODEL@GPU[xN]")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routing-policy", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="one or more; each is a run")
    p.add_argument("--request-rate", nargs="+", type=float, default=[float("inf")],
                   help="requests/s (Poisson, or gamma with --burstiness); one or more, each a run")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--shared-prefixes", type=int, default=8, help="distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=512, help="tokens of each system prompt")
    p.add_argument("--suffix-len", type=int, default=64, help="tokens of each user's own part")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output-len-dist", help="fixed | uniform:a,b | mixed:short,long (default: all --output-len)")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, help="goodput counts requests within this TTFT ...")
    p.add_argument("--slo-tpot-ms", type=float, help="... and this TPOT")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="requests arriving in the first seconds warm the caches but are not measured")
    p.add_argument("--disaggregate", metavar="P:D", help="P prefill + D decode replicas (instead of --replicas)")
    p.add_argument("--kv-transfer-gbps", type=float, default=25.0,
                   help="prefill->decode KV bandwidth, GB/s (default 25: a 200 Gb/s NIC)")
    p.add_argument("--out", help="directory for fleet_sim.json, fleet_sim.md and the plots")
    add_engine_args(p)
    p.set_defaults(func=cmd_simulate_fleet)
