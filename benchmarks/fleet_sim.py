"""Fleet simulation at scale: 64 simulated replicas behind each routing policy, at thousands of req/s.

    .venv/bin/python benchmarks/fleet_sim.py [--cost-model llama-3-8b@h100] [--quick]
    .venv/bin/python benchmarks/fleet_sim.py check-real --hit-rate 0.883 --ttft-ms 86.5 --policy prefix-aware \
        --dataset shared_prefix.jsonl --num-prompts 128 --request-rate 4 --cost-model cal.json \
        [--serving-path-ms 13] [engine flags]

Each replica is the real scheduler and KV cache on a virtual clock (`tokenloom.sim.fleet`), one H100
running Llama-3-8B by the roofline preset (or a calibration file), with vLLM-like server knobs
(max_num_seqs 256, max_num_batched_tokens 8192, KV = 90% of memory minus weights: ~430k tokens).
Workload: many users behind shared system prompts of 2048 tokens, each request adding 256 tokens of its
own and asking for 8-32 output tokens (uniform), Poisson arrivals. Scenarios:

- ``8-prefixes``: the issue's case. Every replica's KV holds all 8 prompts many times over.
- ``512-prefixes``: many tenants; the prompts (1M tokens) are 2.4x one replica's KV.
- ``8-prefixes-disaggregated-32p32d`` and ``-48p16d``: 32 prefill + 32 decode replicas, and 48 + 16
  (prefix-aware over the prefill ones, least-loaded decode, the prompt's KV over a 25 GB/s link; the
  decode replica streams every token, as fleet/replica.py serves it) on the first workload.

One run per (policy, rate), every run the same 4000 requests at its rate; requests arriving in the first
20% of the arrival window warm the caches and are not measured. Goodput counts requests within TTFT
500 ms and TPOT 50 ms. Writes benchmarks/results/fleet_sim.{json,md} and PNGs (goodput vs rate, hit
rate, TTFT CDF per scenario). Virtual time: CPU contention changes the wall time, not the numbers.

`check-real` simulates the real 2-replica run's setup (its requests: the very prompts of its `bench serve
--dataset` file, tokenized as the server does, at the same arrival times — or a `shared_prefix_workload`
by flags; its engine flags, defaults as `tokenloom serve`'s: stall-free factor 1.5, float16 KV) with a
cost model of this machine, and prints the simulated prefix-cache hit rate and TTFT (median by default,
as benchmarks/fleet.md reports it) beside the measured ones, flagging any off by more than 15% (exit 1). The
cost model should come from the replicas' own steps in such a run (`tokenloom serve ... --record-steps F`,
then `tokenloom calibrate --from-steps F-*.jsonl --out cal.json`): a quiet calibration (`tokenloom calibrate
--quantization auto --num-threads 1`) measures about half the step time replicas sharing 2 cores with Ray
and the clients take. `benchmarks/fleet.py --parts routing` runs this check on every policy's run itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from tokenloom.bench.datasets import parse_output_len_dist
from tokenloom.config import EngineConfig, add_engine_args, engine_config_from_args
from tokenloom.fleet.routing import POLICIES
from tokenloom.sim.cli import fit_preset
from tokenloom.sim.fleet import Disaggregation
from tokenloom.sim.fleet_cli import load_cost
from tokenloom.sim.fleet_plots import write_plots
from tokenloom.sim.fleet_report import (
    SharedPrefixSpec,
    check_against_real,
    dataset_workload,
    markdown_table,
    sweep,
)

RESULTS = Path(__file__).parent / "results"
SLO_TTFT_MS, SLO_TPOT_MS = 500.0, 50.0
WARMUP_SHARE = 0.2


def scenarios(num_prompts: int, quick: bool) -> dict[str, dict]:
    outs = tuple(parse_output_len_dist("uniform:8,32", 16, num_prompts, seed=1))
    few = SharedPrefixSpec(num_prompts, 8, 2048, 256, outs)
    many = SharedPrefixSpec(num_prompts, 512, 2048, 256, outs)
    if quick:
        return {"8-prefixes": {"spec": few, "rates": (100.0, 200.0), "policies": POLICIES, "replicas": 8},
                "8-prefixes-disaggregated": {"spec": few, "rates": (100.0,), "policies": ("prefix-aware",),
                                             "replicas": 8, "disaggregation": Disaggregation(4, 4)}}
    return {
        "8-prefixes": {"spec": few, "rates": (1000.0, 2000.0, 3000.0), "policies": POLICIES, "replicas": 64},
        "512-prefixes": {"spec": many, "rates": (500.0, 1000.0, 2000.0), "policies": POLICIES, "replicas": 64},
        **{f"8-prefixes-disaggregated-{p}p{d}d": {"spec": few, "rates": (1000.0, 2000.0, 3000.0),
                                                  "policies": ("prefix-aware",), "replicas": 64,
                                                  "disaggregation": Disaggregation(p, d)}
           for p, d in ((32, 32), (48, 16))},
    }


def engine_config(cost) -> EngineConfig:
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    if cost.kind == "roofline":
        fit_preset(config, cost)
    return config


def run_scale_out(args) -> int:
    from tokenloom.model.loader import bundled_model_path
    from tokenloom.model.tokenizer import load_tokenizer

    cost = load_cost(args.cost_model)
    config = engine_config(cost)
    tokenizer = load_tokenizer(bundled_model_path())  # once: the simulated engines only detokenize
    results = Path(args.out)
    out = {"cost_model": cost.to_dict(), "engine": dataclasses.asdict(config), "slo_ttft_ms": SLO_TTFT_MS,
           "slo_tpot_ms": SLO_TPOT_MS, "warmup_share": WARMUP_SHARE, "scenarios": {}}
    title = f"# Fleet simulation: {cost.to_dict().get('model', 'calibrated')} on {cost.to_dict().get('hardware', cost.kind)}\n"
    legend = ("Generated by `benchmarks/fleet_sim.py` (virtual time; see its docstring for the setup). "
              f"Goodput: requests/s within TTFT {SLO_TTFT_MS:.0f} ms and TPOT {SLO_TPOT_MS:.0f} ms. "
              "Hit rate: prompt tokens served by the prefix cache. Queue: arrival to first scheduled. "
              "Measured requests only (the first 20% of arrivals warm up). Throughput and goodput are vLLM's: "
              "requests completed (within the SLO) / time from the warm-up's end to the last finish, so they "
              "include the drain after the last arrival (at 4000 requests, 10-25% of the window): compare "
              "them across policies, and read the share in the SLO beside them. Requests per replica: the "
              "busiest replica's count over the mean (1 = even) among the replicas taking arrivals.\n")
    md = [title, legend]
    t_all = time.perf_counter()
    for name, sc in scenarios(args.num_prompts, args.quick).items():
        spec, disagg = sc["spec"], sc.get("disaggregation")
        print(f"{name}: {sc['replicas']} replicas", file=sys.stderr)
        t0 = time.perf_counter()
        records = []
        for rate in sc["rates"]:  # warm-up as a share of each rate's arrival window
            records += sweep(cost, spec, sc["policies"], [rate], sc["replicas"], config, disagg, SLO_TTFT_MS,
                             SLO_TPOT_MS, WARMUP_SHARE * spec.num_prompts / rate, tokenizer, _progress)
        records.sort(key=lambda r: (POLICIES.index(r["policy"]), r["request_rate"]))
        wall = time.perf_counter() - t0
        out["scenarios"][name] = {"replicas": sc["replicas"], "workload": spec.describe(),
                                  "disaggregate": dataclasses.asdict(disagg) if disagg else None,
                                  "wall_s": wall, "runs": records}
        md += [f"\n## {name}\n", _describe(spec, sc), markdown_table(records)]
        results.mkdir(parents=True, exist_ok=True)
        for path in write_plots(records, results, f"fleet_sim-{name}"):
            print(f"wrote {path}", file=sys.stderr)
    out["wall_s"] = time.perf_counter() - t_all
    md.append(f"\nWall time {out['wall_s']:.0f} s on one core.\n")
    (results / "fleet_sim.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    (results / "fleet_sim.md").write_text("\n".join(md))
    print(f"wrote {results / 'fleet_sim.json'} and fleet_sim.md in {out['wall_s']:.0f} s", file=sys.stderr)
    return 0


def _describe(spec: SharedPrefixSpec, sc: dict) -> str:
    d = sc.get("disaggregation")
    shape = f"{d.prefill} prefill + {d.decode} decode replicas" if d else f"{sc['replicas']} replicas"
    outs = spec.describe()["output_len"]
    return (f"{shape}; {spec.num_prompts} requests: {spec.shared_prefixes} system prompts of {spec.prefix_len} "
            f"tokens + {spec.suffix_len} own tokens, outputs {outs['min']}-{outs['max']} tokens.\n")


def _progress(r: dict) -> None:
    print(f"  {r['policy']:<13} {r['request_rate']:>6g} req/s: throughput {r['request_throughput']:7.1f}  "
          f"goodput {r['goodput']:7.1f}  hit {r['prefix_hit_rate']:.3f}  TTFT {r['mean_ttft_ms']:7.1f} ms",
          file=sys.stderr)


def check_real(args) -> int:
    """The simulated twin of a measured run, beside its hit rate and TTFT."""
    cost = load_cost(args.cost_model)
    config = engine_config_from_args(args)
    if cost.kind == "roofline":
        fit_preset(config, cost)
    if args.dataset:
        workload = dataset_workload(args.dataset, args.num_prompts, args.request_rate, seed=args.workload_seed)
    else:
        spec = SharedPrefixSpec(args.num_prompts, args.shared_prefixes, args.prefix_len, args.suffix_len,
                                args.output_len, seed=args.workload_seed)
        workload = spec.workload(args.request_rate)
    report = check_against_real(args.hit_rate, args.ttft_ms, cost, workload, args.replicas, args.policy, config,
                                args.ttft_stat, serving_path_s=args.serving_path_ms / 1000)
    return 0 if all(m["within"] for m in report.values()) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check-real"]:
        ap = argparse.ArgumentParser(description=check_real.__doc__)
        ap.add_argument("--hit-rate", type=float, required=True, help="the real run's prefix-cache hit rate (0-1)")
        ap.add_argument("--ttft-ms", type=float, required=True, help="the real run's TTFT (--ttft-stat)")
        ap.add_argument("--ttft-stat", choices=("mean", "median", "p90", "p99"), default="median")
        ap.add_argument("--serving-path-ms", type=float, default=0.0,
                        help="the serving path's time outside the engines, added to each simulated TTFT: a real "
                             "run's client mean TTFT minus its replicas' (benchmarks/fleet.py reports both)")
        ap.add_argument("--dataset", help="the real run's `bench serve --dataset` .jsonl: its very prompts")
        ap.add_argument("--cost-model", default=str(RESULTS / "calibration.json"))
        ap.add_argument("--replicas", type=int, default=2)
        ap.add_argument("--policy", choices=POLICIES, default="prefix-aware")
        ap.add_argument("--num-prompts", type=int, default=128)
        ap.add_argument("--request-rate", type=float, required=True)
        ap.add_argument("--shared-prefixes", type=int, default=8)
        ap.add_argument("--prefix-len", type=int, default=512)
        ap.add_argument("--suffix-len", type=int, default=64)
        ap.add_argument("--output-len", type=int, default=32)
        ap.add_argument("--workload-seed", type=int, default=0)
        add_engine_args(ap)
        # What `tokenloom serve` runs by default (stall-free batching; a float16 KV cache on the quantized
        # path), so each simulated replica has the real one's KV blocks and step plans.
        ap.set_defaults(stall_free_factor=1.5, kv_cache_dtype="float16")
        return check_real(ap.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cost-model", default="llama-3-8b@h100", help="a preset MODEL@GPU or a calibration file")
    ap.add_argument("--num-prompts", type=int, default=4000)
    ap.add_argument("--quick", action="store_true", help="8 replicas, low rates: a smoke test of this script")
    ap.add_argument("--out", default=str(RESULTS))
    return run_scale_out(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
