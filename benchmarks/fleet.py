"""The fleet on this machine, measured: what Ray Serve costs, and what prefix-aware routing buys.

1. Overhead: plain `tokenloom serve` against the same engine behind Ray Serve with one replica
   (`--data-parallel-backend ray`: this process's HTTP front -> the replica through its Ray handle),
   same cores, serving defaults, the two alternating for `--rounds` rounds (medians). Cells
   (`tokenloom bench serve`, streaming): c=1 (16 requests, 128-token prompts, 64 tokens out) and c=32
   (64 requests, 32 concurrent, outputs alternating 16 / 256). The target: throughput and TTFT within 10%.
   The engines record their steps (`--record-steps`), and each cell's wall time is split into the model
   forward, the engine's own work around it, and the time between steps (the engine idle or waiting):
   which part Ray's path costs; and the CPU the cell used (/proc), by who used it.
2. Routing: two replicas of one core each (`--data-parallel-size 2`) under each routing policy, on a
   shared-prefix workload: 8 system prompts (~300 tokens) x 16 users, shuffled, Poisson arrivals at
   `--rate` requests/s, 32 tokens out. Reported: TTFT, throughput, and the fleet's prefix-cache hit rate
   (tokens, from the change in the summed /metrics counters over the run).

Servers take turns (one up at a time). Run on a quiet machine:

    .venv/bin/python benchmarks/fleet.py [--parts overhead,routing] [--out benchmarks/results/fleet.json]

Waits while /work/notes/BENCH_LOCK exists (another benchmark runs), then holds it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lock import holding_lock
from raw_runs import add_raw_dir_option, raw_dir
from server_process import start_server, stop

ROOT = Path(__file__).resolve().parent
PORT = 8391
TOKENLOOM = os.path.join(os.path.dirname(sys.executable), "tokenloom")

OVERHEAD_CELLS = {
    "c1": ["--dataset", "random", "--num-prompts", "16", "--max-concurrency", "1", "--input-len", "128",
           "--output-len", "64"],
    "c32": ["--dataset", "mixed", "--num-prompts", "64", "--max-concurrency", "32", "--input-len", "128"],
}
OVERHEAD_SETUPS = {"plain": [], "ray-1-replica": ["--data-parallel-backend", "ray"]}
# Ray setups with the replica's stream batched otherwise than the default (`--stream-intervals 0,150`).
RAY = OVERHEAD_SETUPS["ray-1-replica"]
POLICIES = ("round-robin", "least-loaded", "prefix-aware")


def bench(cell_args: list[str], out: Path) -> dict:
    cmd = [TOKENLOOM, "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}", "--no-progress",
           "--no-align-prompts", "--seed", "0", "--out", str(out), *cell_args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summed(name: str) -> float:
    """A counter's fleet total (the line without a `replica` label; a single server has only that)."""
    for line in httpx.get(f"http://127.0.0.1:{PORT}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and "replica=" not in line:
            return float(line.split()[-1])
    return 0.0


def serve(extra: list[str], log: Path):
    cmd = [TOKENLOOM, "serve", "--port", str(PORT), "--disable-log-requests", "--metrics-open", *extra]
    return start_server(cmd, PORT, log)


def row(res: dict) -> dict:
    return {"output_tok_s": res["output_throughput"], "median_ttft_ms": res["median_ttft_ms"],
            "p90_ttft_ms": res.get("p90_ttft_ms"), "median_tpot_ms": res["median_tpot_ms"],
            "completed": res["completed"], "failed": res.get("failed", 0)}


def step_split(steps: list[dict], start: float, end: float) -> dict:
    """Where a cell's wall time [start, end) (time.monotonic, the engines' step clock) went, from the step
    records (`read_step_records`) in it: in the model forward, in the rest of the steps, and outside any step."""
    steps = [rec for rec in steps if start <= rec["start"] and rec["end"] <= end]
    in_steps = sum(rec["end"] - rec["start"] for rec in steps)
    forward = sum(rec["forward"] for rec in steps)
    return {"steps": len(steps), "forward_s": forward, "step_rest_s": in_steps - forward,
            "outside_steps_s": (end - start) - in_steps}


def thread_cpu_seconds() -> dict[tuple[int, int], float]:
    """(pid, tid) -> CPU seconds so far, for every thread on the machine."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds[(int(stat.parts[2]), int(stat.parts[4]))] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def cpu_split(before: dict, after: dict, client_s: float, engine_pid: int, front_pid: int, wall: float) -> dict:
    """Cores' worth of CPU a cell used, by who used it: the engine process's two busiest threads (the
    forward's: the engine thread and the kernels' other thread), its other threads, the HTTP front when
    it is another process, the load generator, and every other process (Ray's daemons, Serve's controller;
    the OS)."""
    used = {key: after[key] - before.get(key, 0.0) for key in after}
    engine = sorted((t for (pid, _), t in used.items() if pid == engine_pid), reverse=True)
    front = sum(t for (pid, _), t in used.items() if pid == front_pid) if front_pid != engine_pid else 0.0
    others = sum(t for (pid, _), t in used.items() if pid not in (engine_pid, front_pid, os.getpid()))
    return {"cpu_forward_threads": sum(engine[:2]) / wall, "cpu_engine_other": sum(engine[2:]) / wall,
            "cpu_front": front / wall, "cpu_client": client_s / wall, "cpu_others": others / wall}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def overhead(raw: Path, rounds: int, intervals: list[str]) -> dict:
    """Each setup `rounds` times, alternating (the machine drifts by 20% between minutes), medians kept.
    Odd rounds run the setups in reverse order (ABBA), so that a drift within a round does not always
    favour the setup that goes first.
    `intervals`: more Ray setups, with these --stream-batching-interval-ms."""
    from tokenloom.engine.step_log import read_step_records

    setups = {**OVERHEAD_SETUPS, **{f"ray-1-replica-{ms}ms": [*RAY, "--stream-batching-interval-ms", ms]
                                    for ms in intervals}}
    runs: dict[str, dict[str, list[dict]]] = {setup: {cell: [] for cell in OVERHEAD_CELLS} for setup in setups}
    for r in range(rounds):
        for setup, extra in (reversed(setups.items()) if r % 2 else setups.items()):
            print(f"== overhead: {setup}, round {r + 1}", flush=True)
            steps = raw / f"steps-{setup}-{r + 1}.jsonl"  # a Ray replica's file has its pid added
            for old in raw.glob(f"{steps.stem}*.jsonl"):
                old.unlink()
            proc = serve([*extra, "--record-steps", str(steps)], raw / f"{setup}.log")
            windows = {}
            try:
                bench(["--num-prompts", "4", "--output-len", "8"], raw / "warm-up.json")
                step_files = sorted(raw.glob(f"{steps.stem}*.jsonl"))
                engine_pid = proc.pid if setup == "plain" else int(step_files[0].stem.rsplit("-", 1)[1])
                for cell, cell_args in OVERHEAD_CELLS.items():
                    cpu, client, start = thread_cpu_seconds(), children_cpu_seconds(), time.monotonic()
                    runs[setup][cell].append(row(bench(cell_args, raw / f"{setup}-{cell}-{r + 1}.json")))
                    windows[cell] = (start, time.monotonic())
                    runs[setup][cell][-1].update(cpu_split(cpu, thread_cpu_seconds(), children_cpu_seconds() - client,
                                                           engine_pid, proc.pid, windows[cell][1] - start))
                    print(f"  {cell}: {runs[setup][cell][-1]}", flush=True)
            finally:
                stop(proc)
            steps_run = [rec for path in step_files for rec in read_step_records(str(path))]
            for cell, (start, end) in windows.items():
                runs[setup][cell][-1].update(step_split(steps_run, start, end))
    rows = {setup: {cell: {key: statistics.median(run[key] for run in cell_runs) for key in cell_runs[0]}
                    for cell, cell_runs in by_cell.items()} for setup, by_cell in runs.items()}
    ratios = {setup: {cell: {"throughput": rows[setup][cell]["output_tok_s"] / rows["plain"][cell]["output_tok_s"],
                             "median_ttft": rows[setup][cell]["median_ttft_ms"] / rows["plain"][cell]["median_ttft_ms"]}
                      for cell in OVERHEAD_CELLS} for setup in setups if setup != "plain"}
    return {"rounds": rounds, "rows": rows, "ray_over_plain": ratios, "runs": runs}


def shared_prefix_dataset(path: Path, systems: int = 8, users: int = 16, seed: int = 0) -> Path:
    """8 system prompts of ~300 tokens, each with 16 users' questions, shuffled (a bench serve jsonl)."""
    rng = random.Random(seed)
    topics = ["billing", "shipping", "returns", "warranty", "accounts", "security", "orders", "refunds"]
    lines = []
    for s in range(systems):
        rules = " ".join(f"Rule {k}: when a customer asks about {topics[(s + k) % 8]}, answer in at most "
                         f"{k + 2} sentences, cite policy section {s}.{k}, and never promise a date." for k in range(12))
        system = f"You are the support assistant of shop number {s}. {rules}"
        for u in range(users):
            lines.append({"prompt": f"{system}\nCustomer {u}: my order {1000 + 37 * u + s} has not arrived; "
                                    f"what should I do?\nAssistant:", "max_tokens": 32})
    rng.shuffle(lines)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def routing(raw: Path, rate: float) -> dict:
    """Each policy's run; the replicas record their steps (raw/steps-POLICY-PID.jsonl) for the simulator's
    check (benchmarks/fleet_sim.py check-real), and the engine-side TTFT (replica arrival to first token,
    from the summed /metrics) is kept beside the client's: the difference is the serving path's."""
    data = shared_prefix_dataset(raw / "shared_prefix.jsonl")
    cell = ["--dataset", str(data), "--num-prompts", "128", "--request-rate", str(rate)]
    counters = {"hits": "tokenloom:prefix_cache_hits_total", "queries": "tokenloom:prefix_cache_queries_total",
                "ttft_sum": "tokenloom:time_to_first_token_seconds_sum",
                "ttft_count": "tokenloom:time_to_first_token_seconds_count"}
    rows: dict[str, dict] = {}
    for policy in POLICIES:
        print(f"== routing: {policy}", flush=True)
        for old in raw.glob(f"steps-{policy}-*.jsonl"):
            old.unlink()
        proc = serve(["--data-parallel-size", "2", "--routing-policy", policy,
                      "--record-steps", str(raw / f"steps-{policy}.jsonl")], raw / f"routing-{policy}.log")
        try:
            bench(["--num-prompts", "2", "--output-len", "4"], raw / "warm-up.json")
            time.sleep(2.5)  # the replicas' counters reach the ingress every second
            before = {key: summed(name) for key, name in counters.items()}
            rows[policy] = row(bench(cell, raw / f"routing-{policy}.json"))
            time.sleep(2.5)
            d = {key: summed(name) - before[key] for key, name in counters.items()}
            rows[policy]["prefix_hit_rate"] = d["hits"] / d["queries"] if d["queries"] else None
            rows[policy]["engine_mean_ttft_ms"] = 1000 * d["ttft_sum"] / d["ttft_count"] if d["ttft_count"] else None
            rows[policy]["mean_ttft_ms"] = json.loads((raw / f"routing-{policy}.json").read_text())["mean_ttft_ms"]
            print(f"  {rows[policy]}", flush=True)
        finally:
            stop(proc)
    return {"rate_req_s": rate, "requests": 128, "rows": rows, "simulated": simulator_check(raw, rows, rate)}


def simulator_check(raw: Path, rows: dict, rate: float) -> dict:
    """The fleet simulator's twin of each policy's run: the same requests at the same times, two simulated
    replicas with `tokenloom serve`'s defaults, a cost model fitted on recorded steps with their spread
    (`calibrate --from-steps`) — this run's own, and the other two runs' — and the serving path's time
    (client TTFT minus the replicas') from the other runs. Its hit rate and TTFT against the measured."""
    from tokenloom.cli import build_parser
    from tokenloom.config import engine_config_from_args
    from tokenloom.engine.cost_model import fit_linear, with_spread
    from tokenloom.engine.step_log import read_step_logs
    from tokenloom.sim.fleet import simulate_fleet
    from tokenloom.sim.fleet_report import compare_with_real, dataset_workload

    config = engine_config_from_args(build_parser().parse_args(["serve"]))
    workload = dataset_workload(str(raw / "shared_prefix.jsonl"), 128, rate)
    steps = {p: read_step_logs(sorted(map(str, raw.glob(f"steps-{p}-*.jsonl")))) for p in rows}
    checks: dict[str, dict] = {}
    for policy, real in rows.items():
        others = [p for p in rows if p != policy]
        path_s = statistics.mean(rows[p]["mean_ttft_ms"] - rows[p]["engine_mean_ttft_ms"] for p in others) / 1000
        for steps_from, samples in (("own", steps[policy]), ("others", [s for p in others for s in steps[p]])):
            cost = with_spread(fit_linear(samples), samples)
            sim = simulate_fleet(cost, workload, 2, policy, config, serving_path_s=path_s).summary()
            print(f"  simulated {policy}, steps from {steps_from} run(s):", flush=True)
            checks[f"{policy}/{steps_from}"] = {
                "policy": policy, "steps_from": steps_from, "serving_path_ms": 1000 * path_s,
                **{stat: compare_with_real(real["prefix_hit_rate"], real[f"{stat}_ttft_ms"], sim, ttft_stat=stat)
                   for stat in ("median", "mean")}}
    return checks


def setup_cell_table(rows: dict, caption: str, columns: dict) -> list[str]:
    """Markdown lines: `caption`, then a row per setup and cell of `rows`, a column per `columns` title
    (its function formats the cell's medians)."""
    lines = ["", caption, "", "| setup | cell | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for setup, by_cell in rows.items():
        for cell, x in by_cell.items():
            lines.append(f"| {setup} | {cell} | " + " | ".join(fmt(x) for fmt in columns.values()) + " |")
    return lines


def write_markdown(result: dict, path: Path) -> None:
    lines = ["# Fleet on Ray Serve: overhead and routing", "",
             f"Command: `{result['command']}`", "", result["machine"], ""]
    if "overhead" in result:
        o = result["overhead"]
        lines += ["## One replica behind Ray Serve vs plain `tokenloom serve` (same cores)", "",
                  (f"Medians of {o['rounds']} rounds, the setups alternating. `ray-1-replica` streams at the "
                  "default --stream-batching-interval-ms; a suffix names another interval."), "",
                  "| setup | cell | plain tok/s | Ray tok/s | ratio | plain TTFT p50 | Ray TTFT p50 | ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for setup, by_cell in o["ray_over_plain"].items():
            for cell, q in by_cell.items():
                p, r = o["rows"]["plain"][cell], o["rows"][setup][cell]
                lines.append(f"| {setup} | {cell} | {p['output_tok_s']:.1f} | {r['output_tok_s']:.1f} | "
                             f"{q['throughput']:.3f} | {p['median_ttft_ms']:.1f} ms | {r['median_ttft_ms']:.1f} ms | "
                             f"{q['median_ttft']:.3f} |")
        lines += setup_cell_table(o["rows"], (
            "Where each cell's wall time went (medians over the rounds), from the steps the engine recorded: in the "
            "model forward (the kernels), in the rest of its steps (scheduling, inputs, sampling, outputs), and "
            "outside any step (no work, or waiting for the next request)."), {
            "steps": lambda x: f"{x['steps']:.0f}", "forward": lambda x: f"{x['forward_s']:.2f} s",
            "rest of the steps": lambda x: f"{x['step_rest_s']:.2f} s",
            "outside steps": lambda x: f"{x['outside_steps_s']:.2f} s",
            "forward per step": lambda x: f"{1000 * x['forward_s'] / x['steps']:.1f} ms"})
        lines += setup_cell_table(o["rows"], (
            "The CPU each cell used, in cores (medians): the engine process's two busiest threads (the forward's), "
            "its other threads, the HTTP front when it is a process of its own, the load generator, and every "
            "other process (for Ray: its daemons, Serve's controller)."),
            {title: lambda x, key=key: f"{x[key]:.3f}" for title, key in (
                ("forward's threads", "cpu_forward_threads"), ("engine's others", "cpu_engine_other"),
                ("front", "cpu_front"), ("load generator", "cpu_client"), ("other processes", "cpu_others"))})
        lines.append("")
    if "routing" in result:
        r = result["routing"]
        lines += [f"## Two replicas, shared-prefix workload (128 requests, Poisson {r['rate_req_s']} req/s)", "",
                  "| policy | prefix hit rate | TTFT p50 | TTFT p90 | TPOT p50 | tok/s | failed |", "|---|---|---|---|---|---|---|"]
        for policy, x in r["rows"].items():
            lines.append(f"| {policy} | {x['prefix_hit_rate']:.3f} | {x['median_ttft_ms']:.1f} ms | "
                         f"{x['p90_ttft_ms']:.1f} ms | {x['median_tpot_ms']:.1f} ms | {x['output_tok_s']:.1f} | "
                         f"{x['failed']} |")
        lines.append("")
        if "simulated" in r:
            lines += ["### The simulator's twin of each run", "",
                      ("`benchmarks/fleet.py`'s `simulator_check`: the same requests and arrival times through the fleet "
                      "simulator (two replicas, the same routing policy, `tokenloom serve`'s defaults), its cost model "
                      "fitted on the steps the replicas recorded (`--record-steps`, then `calibrate --from-steps`, with "
                      "the steps' measured spread) in this policy's own run or in the other two runs, plus the serving "
                      "path's time outside the engines (client TTFT minus the replicas' TTFT, from the other two runs)."),
                      "", ("| policy | steps from | hit rate real / sim | TTFT p50 real / sim | diff | TTFT mean real / sim "
                      "| diff |"), "|---|---|---|---|---|---|---|"]
            for c in r["simulated"].values():
                hit, p50, mean = c["median"]["prefix_hit_rate"], c["median"]["median_ttft_ms"], c["mean"]["mean_ttft_ms"]
                lines.append(f"| {c['policy']} | {'its own run' if c['steps_from'] == 'own' else 'the other runs'} | "
                             f"{hit['real']:.3f} / {hit['simulated']:.3f} | {p50['real']:.1f} / {p50['simulated']:.1f} ms | "
                             f"{100 * p50['relative_difference']:.1f}% | {mean['real']:.1f} / {mean['simulated']:.1f} ms | "
                             f"{100 * mean['relative_difference']:.1f}% |")
            lines.append("")
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="overhead,routing")
    ap.add_argument("--rounds", type=int, default=3, help="overhead part: alternating rounds per setup")
    ap.add_argument("--stream-intervals", default="0", help="overhead part: comma-separated extra Ray setups "
                    "with these --stream-batching-interval-ms (0: one streamed item per engine step)")
    ap.add_argument("--rate", type=float, default=4.0, help="routing part: requests per second (Poisson)")
    ap.add_argument("--out", default=str(ROOT / "results/fleet.json"))
    add_raw_dir_option(ap)
    args = ap.parse_args()
    with holding_lock():
        run(args)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    raw = raw_dir(args.raw_dir, out)
    import platform

    from tokenloom.model.load import usable_cores

    result: dict = {"command": "python " + " ".join(sys.argv),
                    "machine": f"{platform.processor() or platform.machine()}, {usable_cores()} cores"}
    parts = args.parts.split(",")
    if "overhead" in parts:
        result["overhead"] = overhead(raw, args.rounds, [ms for ms in args.stream_intervals.split(",") if ms])
    if "routing" in parts:
        result["routing"] = routing(raw, args.rate)
    out.write_text(json.dumps(result, indent=2))
    write_markdown(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
