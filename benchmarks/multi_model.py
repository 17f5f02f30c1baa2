"""Several models behind one server (issue 54), measured: exactness, the memory budget, a resident
model's speed, two models under load at once, and a swap trace against llama-server.

Servers take turns (one up at a time, except the side-by-side pair, which is the point of that cell),
nothing else running. Sections (`--sections`, all by default):

- **exact**: SmolLM2, Qwen2.5-Coder-0.5B and 1.5B, Gemma 3 270M in one server: each model's greedy text
  for a few prompts equals its own single-model server's, asked alone and then with every model asked
  at once.
- **budget**: three models (SmolLM2, Qwen2.5-Coder-0.5B, Gemma 3 270M) under a `--memory-budget` that
  holds any two but not all three, none loaded at start (a preset with `load_on_startup = false`), so
  the server's RSS then is its fixed part (Python, torch, the web stack). First, requests that differ
  only in per-request options (temperature, top_p, seed, stop, logprobs, max_tokens, JSON mode) to one
  model: its loads stay 1 (no thrash). Then a trace alternating among the three from two clients at once
  while `/metrics` is polled every 50 ms: the resident bytes never over the budget, the peak RSS
  (VmHWM) against budget + fixed part, loads and evictions counted, no 5xx.
- **resident**: TTFT and TPOT of Qwen2.5-Coder-0.5B requests (one at a time) on a server that also
  holds SmolLM2, against `serve qwen2.5-coder-0.5b` alone (ABBA).
- **together**: SmolLM2 and Qwen2.5-Coder-0.5B each under 8 concurrent streams: each alone, then both at
  once, in one multi-model server (the engines take turns) and in two single-model servers side by side
  on the same cores. Reported: each model's streamed tokens per second (together: only while both loads
  run) and the sum of the shares each keeps of its own alone throughput (1.0: nothing lost to sharing;
  the raw summed tok/s over the faster one's alone beside it).
- **swap**: one trace of requests alternating between SmolLM2 and Qwen2.5-Coder-0.5B, one at a time,
  through tokenloom and through llama-server's router mode (`--models-dir`, a child process per model;
  `--llama-server PATH`, else that half is skipped, said so), each with `--models-max 1` (every change
  of model is a swap) and with both resident: total time and the median request that came with a swap.

    .venv/bin/python benchmarks/multi_model.py [--sections exact budget resident together swap] \\
        [--llama-server /tmp/llamacpp/build/bin/llama-server] [--out benchmarks/results/multi-model.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lock import holding_lock
from server_process import start_server, stop

from tokenloom.bench.client import LoadConfig, run_load
from tokenloom.bench.datasets import SampleRequest
from tokenloom.bench.serving_metrics import compute_metrics

SMOL, CODER, CODER_L, GEMMA = "smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"
PORT, PORT2 = 8931, 8932
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about the moon:"]
KV_BYTES = str(256 << 20)  # every server the same KV pool, so bytes compare
RAW = Path(tempfile.gettempdir()) / "multi-model-bench"


def serve(args: list[str], port: int = PORT, name: str = "server") -> subprocess.Popen:
    RAW.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "tokenloom.cli", "serve", *args, "--port", str(port), "--disable-log-requests",
           "--kv-cache-memory-bytes", KV_BYTES]
    return start_server(cmd, port, RAW / f"{name}.log")


def client(port: int = PORT) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)


def greedy(http: httpx.Client, model: str) -> list[str]:
    return [http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": 24, "temperature": 0}
                      ).json()["choices"][0]["text"] for p in PROMPTS]


def scrape(http: httpx.Client) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(samples: dict[str, float], name: str, model: str | None = None) -> float:
    return sum(v for k, v in samples.items() if k.partition("{")[0] == name
               and (model is None or f'model_name="{model}"' in k))


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


# -- exact --------------------------------------------------------------------------------------------

def exact() -> dict:
    models = [SMOL, CODER, CODER_L, GEMMA]
    single = {}
    for m in models:
        proc = serve([m], name=f"exact-{m}")
        try:
            with client() as http:
                single[m] = greedy(http, m)
        finally:
            stop(proc)
    proc = serve(models, name="exact-multi")
    try:
        with client() as http:
            alone = {m: greedy(http, m) for m in models}
            together: dict[str, list[str]] = {}

            def ask(m: str) -> None:
                with client() as h:
                    together[m] = greedy(h, m)

            threads = [threading.Thread(target=ask, args=(m,)) for m in models]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            resident = {m["id"]: m["resident_bytes"] for m in http.get("/v1/models").json()["data"]}
    finally:
        stop(proc)
    return {"models": {m: {"alone_equal": alone[m] == single[m], "together_equal": together.get(m) == single[m],
                           "resident_bytes": resident[m]} for m in models}}


# -- budget -------------------------------------------------------------------------------------------

OPTION_VARIANTS = [{"temperature": 0}, {"temperature": 0.7, "seed": 1}, {"top_p": 0.5, "temperature": 1, "seed": 2},
                   {"max_tokens": 4}, {"stop": ["\n"]}, {"logprobs": 3}, {"presence_penalty": 0.5},
                   {"response_format": {"type": "json_object"}}, {"top_k": 5, "seed": 3}, {"n": 2, "seed": 4}]


def budget(resident: dict[str, int]) -> dict:
    models = [SMOL, CODER, GEMMA]
    sizes = sorted(resident[m] for m in models)
    budget_bytes = sum(sizes) - sizes[0] // 2  # any two fit, all three do not
    preset = RAW / "budget.toml"
    # quoted keys: a catalog name's dots would make TOML nested tables
    preset.write_text("".join(f'["{m}"]\nsource = "{m}"\nload_on_startup = false\n' for m in models))
    proc = serve(["--models-preset", str(preset), "--memory-budget", str(budget_bytes)], name="budget")
    result: dict = {"budget_bytes": budget_bytes, "resident_measured": {m: resident[m] for m in models}}
    try:
        time.sleep(3)
        result["fixed_rss_bytes"] = rss_kib(proc.pid) * 1024
        with client() as http:
            for i, extra in enumerate(OPTION_VARIANTS * 2):
                r = http.post("/v1/completions", json={"model": SMOL, "prompt": f"Request {i}: tell me", "max_tokens": 8,
                                                       **extra})
                r.raise_for_status()
            result["loads_after_option_variants"] = metric(scrape(http), "tokenloom:model_loads", SMOL)
            peak = {"resident": 0.0, "polls": 0}
            done = threading.Event()

            def poll():
                with client() as h:
                    while not done.is_set():
                        peak["resident"] = max(peak["resident"], metric(scrape(h), "tokenloom:models_resident_bytes"))
                        peak["polls"] += 1
                        time.sleep(0.05)

            trace = [models[(i * 7 + i // 3) % 3] for i in range(36)]  # every model often, in changing order
            statuses: list[int] = []

            def send(part: list[str]):
                with client() as h:
                    for i, m in enumerate(part):
                        statuses.append(h.post("/v1/completions", json={"model": m, "prompt": PROMPTS[i % 3],
                                                                         "max_tokens": 16}).status_code)

            poller = threading.Thread(target=poll)
            poller.start()
            started = time.perf_counter()
            senders = [threading.Thread(target=send, args=(trace[k::2],)) for k in range(2)]
            for t in senders:
                t.start()
            for t in senders:
                t.join()
            result["trace_seconds"] = time.perf_counter() - started
            done.set()
            poller.join()
            after = scrape(http)
        result.update(peak_resident_bytes=int(peak["resident"]), polls=peak["polls"],
                      peak_rss_bytes=rss_kib(proc.pid, "VmHWM") * 1024, requests=len(statuses),
                      status_5xx=sum(s >= 500 for s in statuses), status_other=sorted({s for s in statuses if s != 200}),
                      loads=int(metric(after, "tokenloom:model_loads")),
                      evictions=int(metric(after, "tokenloom:model_evictions")))
    finally:
        stop(proc)
    return result


# -- resident / together ------------------------------------------------------------------------------

_PHASES = iter(range(10**6))  # every run's prompts start differently: no prefix-cache hit from an earlier run


def samples(n: int, out_tokens: int, prompt: str = "Write a long story about a lighthouse keeper. " * 8):
    phase = next(_PHASES)
    return [SampleRequest(f"Run {phase}, request {i}: {prompt}", 100, out_tokens) for i in range(n)]


def load_run(port: int, model: str, n: int, concurrency: int, out_tokens: int = 64):
    cfg = LoadConfig(f"http://127.0.0.1:{port}", model, max_concurrency=concurrency, show_progress=False)
    return cfg, samples(n, out_tokens)


def measure(port: int, model: str, n: int, concurrency: int):
    cfg, reqs = load_run(port, model, n, concurrency)
    results, duration = asyncio.run(run_load(cfg, reqs))
    return compute_metrics(results, duration)


def alone_tps(port: int, model: str, n: int, concurrency: int) -> float:
    """Tokens per second of one load alone, counted as `both_at_once` counts them."""
    cfg, reqs = load_run(port, model, n, concurrency)
    times = token_times(asyncio.run(run_load(cfg, reqs))[0])
    return len(times) / (max(times) - min(times))


def token_times(results) -> list[float]:
    """When each streamed chunk (a token) arrived, over every finished request (perf_counter seconds)."""
    times = []
    for r in results:
        if r.success:
            t = r.start_time + r.ttft
            times.append(t)
            for gap in r.itl:
                t += gap
                times.append(t)
    return times


def resident(rounds: int) -> dict:
    cells: dict[str, list] = {"single": [], "multi": []}
    for order in ["single", "multi", "multi", "single"] * (rounds // 2):
        proc = serve([CODER] if order == "single" else [CODER, SMOL], name=f"resident-{order}")
        try:
            measure(PORT, CODER, 2, 1)  # warm-up
            m = measure(PORT, CODER, 8, 1)
            cells[order].append((m.latency_stats["median_ttft_ms"], m.latency_stats["median_tpot_ms"]))
        finally:
            stop(proc)
    med = {k: (statistics.median(t for t, _ in v), statistics.median(p for _, p in v)) for k, v in cells.items()}
    return {"single_ttft_ms": med["single"][0], "single_tpot_ms": med["single"][1], "multi_ttft_ms": med["multi"][0],
            "multi_tpot_ms": med["multi"][1], "ttft_ratio": med["multi"][0] / med["single"][0],
            "tpot_ratio": med["multi"][1] / med["single"][1], "runs": cells}


def both_at_once(ports: dict[str, int], counts: dict[str, int], concurrency: int) -> dict[str, float]:
    """Each model's tokens per second while both loads run: counted from the later first token to the
    earlier last one (the one that finishes first leaves the other alone for its tail, not counted)."""
    async def go():
        runs = [run_load(*load_run(ports[m], m, counts[m], concurrency)) for m in ports]
        return await asyncio.gather(*runs)

    times = {m: token_times(r) for m, (r, _) in zip(ports, asyncio.run(go()), strict=True)}
    t0, t1 = max(min(t) for t in times.values()), min(max(t) for t in times.values())
    return {m: sum(t0 <= x <= t1 for x in t) / (t1 - t0) for m, t in times.items()}


def together(concurrency: int = 8, seconds: float = 40.0) -> dict:
    models = [SMOL, CODER]
    out: dict = {}
    # One multi-model server: each alone, then both.
    proc = serve(models, name="together-multi")
    try:
        alone = {}
        for m in models:
            measure(PORT, m, concurrency, concurrency)  # warm-up
            alone[m] = alone_tps(PORT, m, 4 * concurrency, concurrency)
        counts = {m: max(concurrency, round(alone[m] * seconds / 64)) for m in models}  # ~`seconds` each alone
        both = both_at_once({m: PORT for m in models}, counts, concurrency)
        out["multi"] = {"alone_tps": alone, "together_tps": both}
    finally:
        stop(proc)
    # Two single-model servers on the same cores.
    procs = {SMOL: serve([SMOL], PORT, "together-single-smol"), CODER: serve([CODER], PORT2, "together-single-coder")}
    ports = {SMOL: PORT, CODER: PORT2}
    try:
        alone = {}
        for m in models:
            measure(ports[m], m, concurrency, concurrency)
            alone[m] = alone_tps(ports[m], m, 4 * concurrency, concurrency)
        both = both_at_once(ports, counts, concurrency)
        out["side_by_side"] = {"alone_tps": alone, "together_tps": both}
    finally:
        for p in procs.values():
            stop(p)
    for cell in out.values():
        cell["share_sum"] = sum(cell["together_tps"][m] / cell["alone_tps"][m] for m in models)
        cell["summed_over_faster_alone"] = sum(cell["together_tps"].values()) / max(cell["alone_tps"].values())
    return out


# -- swap ---------------------------------------------------------------------------------------------

SWAP_TRACE = [SMOL, CODER] * 6


def timed_trace(port: int, names: dict[str, str]) -> dict:
    """SWAP_TRACE's requests one after another (`names`: each model's id on that server)."""
    swaps = []  # the requests that came with a change of model
    current = None
    started = time.perf_counter()
    for i, m in enumerate(SWAP_TRACE):
        t0 = time.perf_counter()
        with client(port) as http:
            r = http.post("/v1/completions", json={"model": names[m], "prompt": PROMPTS[i % 3], "max_tokens": 16,
                                                   "temperature": 0})
            r.raise_for_status()
        if current is not None and m != current:
            swaps.append(time.perf_counter() - t0)
        current = m
    return {"total_s": time.perf_counter() - started, "per_swap_request_s": statistics.median(swaps),
            "swaps": len(swaps)}


def swap(llama_server: str | None, llama_first: bool = False) -> dict:
    """Each server's two runs (one model resident at a time, then both); `llama_first` runs
    llama-server's before tokenloom's (two invocations in opposite orders make an ABBA pair)."""
    sides = [_swap_tokenloom, lambda: _swap_llama(llama_server)]
    out: dict = {}
    for side in reversed(sides) if llama_first else sides:
        out.update(side())
    return out


def _swap_tokenloom() -> dict:
    out = {}
    for label, extra in (("tokenloom, --models-max 1", ["--models-max", "1"]), ("tokenloom, both resident", [])):
        proc = serve([SMOL, CODER, *extra], name=f"swap-tokenloom-{len(extra)}")
        try:
            out[label] = timed_trace(PORT, {m: m for m in SWAP_TRACE})
        finally:
            stop(proc)
    return out


def _swap_llama(llama_server: str | None) -> dict:
    if llama_server is None:
        return {"llama-server router": "not measured: no --llama-server given"}
    from tokenloom.model.load import model_path

    models_dir = RAW / "llama-models"
    models_dir.mkdir(exist_ok=True)
    for m in (SMOL, CODER):
        link = models_dir / f"{m}.gguf"
        link.unlink(missing_ok=True)
        link.symlink_to(model_path(m))
    out = {}
    # llama.cpp's router mode: a child llama-server per model, as many resident as --models-max.
    for label, models_max in (("llama-server router, --models-max 1", "1"), ("llama-server router, both resident", "0")):
        cmd = [llama_server, "--models-dir", str(models_dir), "--models-max", models_max, "--port", str(PORT2),
               "-c", "2048", "-t", str(os.cpu_count())]
        proc = start_server(cmd, PORT2, RAW / f"llama-router-{models_max}.log")
        try:
            with client(PORT2) as http:
                ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
            names = {m: next(i for i in ids if m in i) for m in (SMOL, CODER)}
            out[label] = timed_trace(PORT2, names)
        finally:
            stop(proc)
    return out


# -- report -------------------------------------------------------------------------------------------

def markdown(rec: dict, command: str) -> str:
    lines = ["# Several models behind one server (benchmarks/multi_model.py)", "", f"    {command}", "",
             f"{rec['machine']}; {rec['when']}", ""]
    for section, error in rec.get("failed", {}).items():
        lines += [f"**{section} failed**: `{error}`", ""]
    if "exact" in rec:
        lines += ["## Exact", "", "| model | alone = its own server | all asked at once = its own server | resident MiB |",
                  "|---|---|---|---|"]
        for m, c in rec["exact"]["models"].items():
            lines.append(f"| {m} | {'yes' if c['alone_equal'] else 'NO'} | {'yes' if c['together_equal'] else 'NO'} | "
                         f"{c['resident_bytes'] / 2**20:.0f} |")
        lines.append("")
    if "budget" in rec:
        b = rec["budget"]
        lines += ["## Budget", "", f"budget {b['budget_bytes'] / 2**20:.0f} MiB (models: " + ", ".join(
            f"{m} {v / 2**20:.0f} MiB" for m, v in b["resident_measured"].items()) + ")", "",
            f"- requests differing only in options: {SMOL}'s loads {b['loads_after_option_variants']:.0f} (1 = no thrash)",
            (f"- trace: {b['requests']} requests from 2 clients in {b['trace_seconds']:.1f} s, {b['loads']} loads, "
            f"{b['evictions']} evictions, 5xx {b['status_5xx']} (other non-200: {b['status_other']})"),
            (f"- peak resident bytes (polled {b['polls']} times) {b['peak_resident_bytes'] / 2**20:.0f} MiB "
            f"{'<=' if b['peak_resident_bytes'] <= b['budget_bytes'] else '>'} budget"),
            (f"- peak RSS {b['peak_rss_bytes'] / 2**20:.0f} MiB; fixed part (no model loaded) "
            f"{b['fixed_rss_bytes'] / 2**20:.0f} MiB; budget + fixed {(b['budget_bytes'] + b['fixed_rss_bytes']) / 2**20:.0f}"
            f" MiB: {'within' if b['peak_rss_bytes'] <= b['budget_bytes'] + b['fixed_rss_bytes'] else 'OVER'}"), ""]
    if "resident" in rec:
        r = rec["resident"]
        lines += ["## A resident model against its own server (ABBA, medians)", "",
                  "| | TTFT ms | TPOT ms |", "|---|---|---|",
                  f"| serve {CODER} | {r['single_ttft_ms']:.1f} | {r['single_tpot_ms']:.2f} |",
                  f"| serve {CODER} {SMOL} | {r['multi_ttft_ms']:.1f} | {r['multi_tpot_ms']:.2f} |",
                  f"| ratio | {r['ttft_ratio']:.3f} | {r['tpot_ratio']:.3f} |", ""]
    if "together" in rec:
        lines += ["## Two models under load at once (8 streams each; output tok/s)", "",
                  (f"| servers | {SMOL} alone | {CODER} alone | {SMOL} together | {CODER} together | sum of shares | "
                  "summed / faster alone |"), "|---|---|---|---|---|---|---|"]
        for label, c in rec["together"].items():
            a, t = c["alone_tps"], c["together_tps"]
            lines.append(f"| {label} | {a[SMOL]:.0f} | {a[CODER]:.0f} | {t[SMOL]:.0f} | {t[CODER]:.0f} | "
                         f"{c['share_sum']:.2f} | {c['summed_over_faster_alone']:.2f} |")
        lines.append("")
    if "swap" in rec:
        lines += ["## Swap trace (" + " ".join(m.split("-")[0] for m in SWAP_TRACE) + ")", "",
                  "| server | total s | median request with a swap, s | swaps |", "|---|---|---|---|"]
        for label, c in rec["swap"].items():
            lines.append(f"| {label} | {c} |" if isinstance(c, str) else
                         f"| {label} | {c['total_s']:.1f} | {c['per_swap_request_s']:.2f} | {c['swaps']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", default=["exact", "budget", "resident", "together", "swap"])
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--resident-rounds", type=int, default=2, help="servers started per side in `resident` "
                    "(ABBA: an even number; TPOT moves a few percent between starts of one server)")
    ap.add_argument("--swap-order", choices=["tokenloom-first", "llama-first"], default="tokenloom-first",
                    help="which server's swap runs go first (run both orders for an ABBA pair)")
    args = ap.parse_args()
    rec: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                 "when": time.strftime("%Y-%m-%d %H:%M")}
    with holding_lock():
        for section in args.sections:
            started = time.perf_counter()
            try:
                run_section(section, rec, args)
            except Exception as exc:  # noqa: BLE001 - one section's failure is reported; the others still run
                rec.setdefault("failed", {})[section] = repr(exc)
                print(f"{section} FAILED: {exc!r}", flush=True)
                continue
            print(f"{section} done in {time.perf_counter() - started:.0f} s: "
                  f"{json.dumps(rec[section], default=str)[:600]}", flush=True)
    text = markdown(rec, "python benchmarks/multi_model.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rec, indent=1, default=str))
    return 0


def run_section(section: str, rec: dict, args) -> None:
    if section == "exact":
        rec["exact"] = exact()
    elif section == "budget":
        sizes = ({m: c["resident_bytes"] for m, c in rec["exact"]["models"].items()} if "exact" in rec
                 else measured_sizes())
        rec["budget"] = budget(sizes)
    elif section == "resident":
        rec["resident"] = resident(args.resident_rounds)
    elif section == "together":
        rec["together"] = together()
    elif section == "swap":
        rec["swap"] = swap(args.llama_server, args.swap_order == "llama-first")


def measured_sizes() -> dict[str, int]:
    proc = serve([SMOL, CODER, GEMMA], name="sizes")
    try:
        with client() as http:
            return {m["id"]: m["resident_bytes"] for m in http.get("/v1/models").json()["data"]}
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
