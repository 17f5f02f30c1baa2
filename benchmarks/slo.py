"""SLOs as the target (issue 56): goodput under overload per scheduling policy, attainment against load, the
server's own count against the client's, the simulator against the server, and fair shares per tenant.

Per model (servers taking turns, one up at a time, under the benchmark lock):
1. **Capacity**, measured in the same run: a closed loop of `--max-num-seqs` streams over the mixed trace
   under fcfs; capacity = completed requests / s.
2. **SLOs** (unless given): from a run at 0.25x capacity under fcfs, where there is room: TTFT target =
   3x its p90 TTFT, TPOT target = 1.5x its p90 TPOT. Every request carries them in its body (`slo`).
3. **The sweep**: for each policy (fcfs, priority, slo; `slo-shed` = slo with --slo-shed) one server, and
   for each load (default 0.5, 0.75, 1, 1.5, 2 x capacity) an open-loop Poisson trace of `--duration-s`:
   prompts of 32-128 or 256-768 tokens, outputs of 16 or 128 tokens (each half, drawn independently;
   under `priority` the 16-token ones are priority 0, the rest 1). Per cell: goodput (requests meeting
   both targets per second), attainment of TTFT / TPOT / both and throughput as the client counts them
   (`bench serve`'s definitions; a refused request counts as a miss), and the server's
   `tokenloom:slo_attained_total` deltas beside them (the issue's "within 2%").
4. **The simulator**: the fcfs server records its steps (`--record-steps`); `tokenloom calibrate
   --from-steps` fits a cost model on them, and `simulate` replays every cell's trace (same token ids, same
   arrivals, same SLOs) with the same policy; the report puts simulated goodput beside the measured one.
5. **Fairness**: a heavy tenant (`user` "heavy") sending 1.5x capacity and a light one ("light") a
   request every 2 s, under fcfs and under `--fairness vtc`, and the light one alone: the light tenant's
   TTFT p50 in each, and the heavy tenant's output throughput beside its fair share (capacity's output
   throughput less what the light tenant is served).

Writes OUT/slo.json, OUT/slo.md and OUT/slo_attainment.png (attainment and goodput against load, a
panel per model; OUT = benchmarks/results), the server logs, steps and cost models to --raw-dir.

The full run (both models, about 1.5 h on 2 cores: 60 s of arrivals a cell, an overloaded cell draining as long
again; the lead runs it on a quiet machine):

    .venv/bin/python benchmarks/slo.py

A functional check of a few seconds (tiny settings, no conclusions):

    .venv/bin/python benchmarks/slo.py --models smollm2-135m --policies fcfs slo --loads 1 --duration-s 2 \\
        --capacity-requests 8 --slo-ttft-ms 2000 --slo-tpot-ms 200 --skip-sim --skip-fairness --out /tmp/slo-check --raw-dir /tmp/slo-check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokenloom.bench.arrivals import arrival_times
from tokenloom.bench.client import LoadConfig, run_load
from tokenloom.bench.datasets import SampleRequest
from tokenloom.bench.serving_metrics import compute_metrics
from tokenloom.bench.workload import WorkloadRequest

sys.path.insert(0, str(Path(__file__).parent))
from bench_lock import holding_lock
from server_process import start_server, stop

PORT = 8156
# name -> what `tokenloom serve` is given: the bundled SmolLM2-135M, the catalog's Qwen2.5 0.5B (its Coder build)
MODELS = {"smollm2-135m": None, "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b"}
POLICIES = {"fcfs": ["--scheduling-policy", "fcfs"], "priority": ["--scheduling-policy", "priority"],
            "slo": ["--scheduling-policy", "slo"], "slo-shed": ["--scheduling-policy", "slo", "--slo-shed"]}
LOADS = (0.5, 0.75, 1.0, 1.5, 2.0)
ENGINE_ARGS = ["--max-num-seqs", "16", "--max-model-len", "2048", "--num-kv-blocks", "2048",
               "--disable-log-requests", "--log-interval", "60"]
SHORT_PROMPT, LONG_PROMPT, OUTPUTS = (32, 128), (256, 768), (16, 128)
LIGHT_EVERY_S, HEAVY_LOAD = 2.0, 1.5


# -- traces ------------------------------------------------------------------------------------------


def mixed_requests(n: int, seed: int, slo: dict | None, prioritised: bool = False, user: str | None = None):
    """`n` (token ids, max_tokens, priority) of the mixed trace, as SampleRequests carrying their SLO."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lo, hi = SHORT_PROMPT if rng.random() < 0.5 else LONG_PROMPT
        ids = [rng.randrange(1000, 40000) for _ in range(rng.randint(lo, hi))]
        max_tokens = OUTPUTS[rng.random() >= 0.5]
        priority = 0 if max_tokens == OUTPUTS[0] else 1
        extra = {"slo": slo} if slo else {}
        if prioritised:
            extra["priority"] = priority
        if user:
            extra["user"] = user
        out.append(SampleRequest(ids, len(ids), max_tokens, True, extra))
    return out


def as_workload(samples: list[SampleRequest], rate: float, seed: int, burstiness: float = 1.0):
    """The same requests as the simulator's workload: token ids, arrivals as `run_load` draws them."""
    from tokenloom.slo import SLO

    times = arrival_times(len(samples), rate, burstiness, seed)
    return [WorkloadRequest(f"r{i}", list(s.prompt), s.max_tokens, t, (s.extra or {}).get("priority", 0),
                            SLO(**s.extra["slo"]) if (s.extra or {}).get("slo") else None,
                            (s.extra or {}).get("user"))
            for i, (s, t) in enumerate(zip(samples, times, strict=True))]


# -- one server, one load ----------------------------------------------------------------------------


def scrape_attained(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {"requests": 0.0, "ttft": 0.0, "tpot": 0.0, "both": 0.0}
    for line in text.splitlines():
        if line.startswith("tokenloom:slo_requests_total"):
            out["requests"] += float(line.split()[-1])
        elif line.startswith("tokenloom:slo_attained_total"):
            kind = line.split('slo="')[1].split('"')[0]
            out[kind] += float(line.split()[-1])
    return out


def run_cell(url: str, samples, rate: float, seed: int, slo: dict, burstiness: float = 1.0,
             max_concurrency: int | None = None) -> dict:
    cfg = LoadConfig(url, None, request_rate=rate, burstiness=burstiness, seed=seed, show_progress=False,
                     max_concurrency=max_concurrency, request_timeout_s=900)
    before = scrape_attained(url)
    results, duration = asyncio.run(run_load(cfg, samples))
    time.sleep(0.5)  # the last finishes reach /metrics
    after = scrape_attained(url)
    m = compute_metrics(results, duration, slo.get("ttft_ms"), slo.get("tpot_ms"))
    n = len(results)
    met = m.slo_attained or {"ttft": 0, "tpot": 0, "both": 0}
    server = {k: after[k] - before[k] for k in after}
    return {"rate": rate, "requests": n, "completed": m.completed, "failed": m.failed, "duration_s": duration,
            "throughput_rps": m.request_throughput, "output_tps": m.output_throughput,
            "goodput_rps": m.request_goodput or 0.0,
            "attained": {k: met[k] / n for k in met},
            "server_attained": {k: server[k] / server["requests"] if server["requests"] else None
                                for k in ("ttft", "tpot", "both")},
            "server_count_minus_client": {k: server[k] - met[k] for k in met},
            "p50_ttft_ms": m.latency_stats["median_ttft_ms"], "p90_ttft_ms": m.latency_stats["p90_ttft_ms"],
            "p50_tpot_ms": m.latency_stats["median_tpot_ms"], "p90_tpot_ms": m.latency_stats["p90_tpot_ms"],
            "results": results}


def serve(model: str, extra: list[str], out: Path, tag: str):
    source = [MODELS[model]] if MODELS.get(model) else []
    cmd = [os.path.join(os.path.dirname(sys.executable), "tokenloom"), "serve", *source, "--port", str(PORT),
           *ENGINE_ARGS, *extra]
    return start_server(cmd, PORT, out / f"server-{model}-{tag}.log")


# -- per model ---------------------------------------------------------------------------------------


def bench_model(model: str, args, out: Path) -> dict:
    url = f"http://127.0.0.1:{PORT}"
    record = {"model": model}
    steps = out / f"steps-{model}.jsonl"
    steps.unlink(missing_ok=True)
    proc = serve(model, ["--scheduling-policy", "fcfs", *([] if args.skip_sim else ["--record-steps", str(steps)])],
                 out, "fcfs-capacity")
    try:
        warm = mixed_requests(4, 99, None)
        run_cell(url, warm, math.inf, 0, {}, max_concurrency=4)
        cap = run_cell(url, mixed_requests(args.capacity_requests, 1, None), math.inf, 1, {}, max_concurrency=16)
        capacity = cap["throughput_rps"]
        if not cap["completed"]:
            raise RuntimeError(f"{model}: no request of the capacity run succeeded (see {out}/server-*.log)")
        record["capacity"] = {"rps": capacity, "output_tps": cap["output_tps"]}
        print(f"{model}: capacity {capacity:.2f} req/s, {cap['output_tps']:.0f} output tok/s", flush=True)
        if args.skip_sweep:
            slo = {"ttft_ms": None, "tpot_ms": None}
        elif args.slo_ttft_ms and args.slo_tpot_ms:
            slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
        else:
            low = run_cell(url, mixed_requests(max(8, round(0.25 * capacity * args.duration_s)), 2, None),
                           0.25 * capacity, 2, {})
            slo = {"ttft_ms": round(3 * low["p90_ttft_ms"]), "tpot_ms": round(1.5 * low["p90_tpot_ms"], 1)}
        record["slo"] = slo
        print(f"{model}: SLO {slo}", flush=True)
    finally:
        stop(proc)

    record["sweep"] = {}
    traces = {}
    for policy in [] if args.skip_sweep else args.policies:
        proc = serve(model, POLICIES[policy], out, policy)
        try:
            cells = []
            for load in args.loads:
                rate = load * capacity
                n = max(4, round(rate * args.duration_s))
                seed = 10 + int(load * 100)
                samples = mixed_requests(n, seed, slo, prioritised=policy == "priority")
                traces[(policy, load)] = (samples, rate, seed)
                cell = run_cell(url, samples, rate, seed, slo)
                cell.pop("results")
                cell["load"] = load
                cells.append(cell)
                print(f"{model} {policy:>8} {load:.2f}x: goodput {cell['goodput_rps']:.2f} req/s, attained both "
                      f"{cell['attained']['both']:.0%} (server {cell['server_attained']['both'] or 0:.0%}), "
                      f"throughput {cell['throughput_rps']:.2f} req/s", flush=True)
                time.sleep(2)
            record["sweep"][policy] = cells
        finally:
            stop(proc)

    if not args.skip_sim and traces:
        record["sim"] = simulate_cells(model, steps, traces, out)
    if not args.skip_fairness:
        record["fairness"] = fairness(model, capacity, cap["output_tps"], args, out)
    return record


def simulate_cells(model: str, steps: Path, traces: dict, out: Path) -> dict:
    """The same traces through the simulator, on a cost model fitted to the fcfs server's own steps."""
    from tokenloom import EngineConfig
    from tokenloom.sim.cost_model import load_cost_model
    from tokenloom.sim.simulator import simulate

    cost_path = out / f"cost-{model}.json"
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "tokenloom"), "calibrate", "--from-steps",
                    str(steps), "--out", str(cost_path)], check=True)
    cost = load_cost_model(str(cost_path))
    sim: dict = {}
    for (policy, load), (samples, rate, seed) in traces.items():
        flags = POLICIES[policy]
        config = EngineConfig(max_num_seqs=16, max_model_len=2048, num_kv_blocks=2048, stall_free_factor=1.5,
                              scheduling_policy=flags[1], slo_shed="--slo-shed" in flags)
        s = simulate(cost, as_workload(samples, rate, seed), config).summary()
        sim.setdefault(policy, []).append({"load": load, "goodput_rps": s.get("goodput", 0.0),
                                           "attained_both": s.get("slo_attained_both"),
                                           "throughput_rps": s["request_throughput"]})
    return sim


def fairness(model: str, capacity: float, capacity_tps: float, args, out: Path) -> dict:
    url = f"http://127.0.0.1:{PORT}"
    d = args.duration_s
    n_light = max(2, round(d / LIGHT_EVERY_S))
    res = {}
    for name, extra in (("fcfs", []), ("vtc", ["--fairness", "vtc"])):
        proc = serve(model, extra, out, f"fair-{name}")
        try:
            heavy = mixed_requests(max(4, round(HEAVY_LOAD * capacity * d)), 7, None, user="heavy")
            light = mixed_requests(n_light, 8, None, user="light")

            async def both(heavy=heavy, light=light):
                h = LoadConfig(url, None, request_rate=HEAVY_LOAD * capacity, seed=7, show_progress=False,
                               request_timeout_s=900)
                lt = LoadConfig(url, None, request_rate=1 / LIGHT_EVERY_S, burstiness=1e6, seed=8,
                                show_progress=False, request_timeout_s=900)
                return await asyncio.gather(run_load(h, heavy), run_load(lt, light))

            (hr, hd), (lr, ld) = asyncio.run(both())
            hm, lm = compute_metrics(hr, hd), compute_metrics(lr, ld)
            res[name] = {"light_p50_ttft_ms": lm.latency_stats["median_ttft_ms"],
                         "heavy_output_tps": hm.output_throughput, "light_output_tps": lm.output_throughput,
                         "heavy_fair_share_tps": capacity_tps - lm.output_throughput}
            if name == "fcfs":
                time.sleep(2)
                alone = run_cell(url, mixed_requests(n_light, 8, None, user="light"), 1 / LIGHT_EVERY_S, 8, {},
                                 burstiness=1e6)
                res["light_alone_p50_ttft_ms"] = alone["p50_ttft_ms"]
        finally:
            stop(proc)
    res["light_vtc_over_fcfs"] = res["vtc"]["light_p50_ttft_ms"] / max(res["fcfs"]["light_p50_ttft_ms"], 1e-9)
    res["light_vtc_over_alone"] = res["vtc"]["light_p50_ttft_ms"] / max(res["light_alone_p50_ttft_ms"], 1e-9)
    print(f"{model} fairness: light TTFT p50 vtc/fcfs {res['light_vtc_over_fcfs']:.2f}, vtc/alone "
          f"{res['light_vtc_over_alone']:.2f}", flush=True)
    return res


# -- report ------------------------------------------------------------------------------------------


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(records), figsize=(5 * len(records), 7), squeeze=False)
    for col, rec in enumerate(records):
        for policy, cells in rec["sweep"].items():
            loads = [c["load"] for c in cells]
            axes[0][col].plot(loads, [100 * c["attained"]["both"] for c in cells], marker="o", label=policy)
            axes[1][col].plot(loads, [c["goodput_rps"] for c in cells], marker="o", label=policy)
        axes[0][col].set_title(f"{rec['model']}: SLO ttft {rec['slo']['ttft_ms']} ms, tpot {rec['slo']['tpot_ms']} ms")
        axes[0][col].set_ylabel("requests meeting both (%)")
        axes[1][col].set_ylabel("goodput (req/s)")
        axes[1][col].set_xlabel("load (x measured capacity)")
        axes[0][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(records: list[dict], meta: dict) -> str:
    lines = ["# SLOs as the target (benchmarks/slo.py)", "", f"`{meta['command']}` on {meta['machine']}", ""]
    for rec in records:
        lines += [f"## {rec['model']}", "", f"capacity {rec['capacity']['rps']:.2f} req/s; SLO {rec['slo']}", "",
                  ("| policy | load | goodput (req/s) | ttft / tpot / both met (client) | both (server) | "
                   "throughput (req/s) | sim goodput |"), "|---|---|---|---|---|---|---|"]
        sim = rec.get("sim", {})
        for policy, cells in rec["sweep"].items():
            for i, c in enumerate(cells):
                a = c["attained"]
                s = sim.get(policy, [{}] * len(cells))[i].get("goodput_rps")
                lines.append(f"| {policy} | {c['load']:.2f}x | {c['goodput_rps']:.2f} | {a['ttft']:.0%} / "
                             f"{a['tpot']:.0%} / {a['both']:.0%} | {c['server_attained']['both'] or 0:.0%} | "
                             f"{c['throughput_rps']:.2f} | {'' if s is None else f'{s:.2f}'} |")
        if "fairness" in rec:
            f = rec["fairness"]
            lines += ["", (f"fairness: light TTFT p50 fcfs {f['fcfs']['light_p50_ttft_ms']:.0f} ms, vtc "
                           f"{f['vtc']['light_p50_ttft_ms']:.0f} ms, alone {f['light_alone_p50_ttft_ms']:.0f} ms; "
                           f"heavy output {f['vtc']['heavy_output_tps']:.0f} tok/s under vtc (fair share "
                           f"{f['vtc']['heavy_fair_share_tps']:.0f})")]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--policies", nargs="+", default=["fcfs", "priority", "slo"], choices=list(POLICIES))
    p.add_argument("--loads", nargs="+", type=float, default=list(LOADS))
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals per cell")
    p.add_argument("--capacity-requests", type=int, default=96)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="default: 3x the p90 TTFT at 0.25x capacity")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="default: 1.5x the p90 TPOT at 0.25x capacity")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--skip-sweep", action="store_true", help="capacity and fairness only (no SLO sweep, no sim)")
    p.add_argument("--skip-fairness", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="slo.json, slo.md, the plot")
    p.add_argument("--raw-dir", type=Path, default=Path("benchmarks/runs/slo"),
                   help="server logs, recorded steps, the fitted cost model")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    cpu = platform.processor() or platform.machine()
    meta = {"command": " ".join(["benchmarks/slo.py", *sys.argv[1:]]), "machine": f"{cpu}, {os.cpu_count()} cores",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with holding_lock():
        records = [bench_model(m, args, args.raw_dir) for m in args.models]
    (args.out / "slo.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1, default=float))
    (args.out / "slo.md").write_text(markdown(records, meta))
    if any(r["sweep"] for r in records):
        plot(records, args.out / "slo_attainment.png")
    print(f"wrote {args.out}/slo.json, slo.md, slo_attainment.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
