"""Speculative decoding on SmolLM2 behind `tokenloom serve`: output tok/s with and without it.

Servers take turns (one up at a time), each serving the bundled model as shipped (`--quantization auto`),
measured by `tokenloom bench serve` (greedy, streaming) in three cells:
- grounded: c=1, chat, benchmarks/data/grounded.jsonl (20 prompts of 300-1,000 tokens whose answers copy
  spans of the input: repeat, fix typos, rename in code, edit a list), up to 256 tokens, ends at EOS;
- free: c=1, chat, benchmarks/data/freewrite.jsonl (12 short prompts, stories and explanations), 256 tokens;
- mixed: 64 requests, 32 concurrent, outputs alternating 16 / 256 (the peers' throughput cell).
Greedy output is the same token for token with and without speculation, so each cell does the same work
in every setting. Acceptance per draft position is read from /metrics
(`tokenloom:spec_decode_num_accepted_tokens_per_pos`) after each cell.

Peers on the same GGUF and cores, in the same cells: llama.cpp's `llama-server` without and with its
n-gram speculation (`--spec-type ngram-simple` / `ngram-map-k`; `bash ../shared/tools/build_llamacpp.sh`)
and vLLM-CPU without and with its `ngram` method (`bash ../shared/tools/vllm_cpu_peer.sh setup`).

    .venv/bin/python benchmarks/speculative.py [--out benchmarks/results/speculative.json] [--settings off,ngram]
    .venv/bin/python benchmarks/speculative.py --out benchmarks/results/speculative-peers.json \
        --settings off,ngram,llama-off,llama-ngram-simple,llama-ngram-map-k,vllm-off,vllm-ngram
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from raw_runs import add_raw_dir_option, raw_dir
from server_process import start_server, stop

from tokenloom.model.kernels import cpu_flags

PORT = 8133
ROOT = Path(__file__).resolve().parent


def ngram_json(k: int, lookup_min: int = 2) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": lookup_min}, separators=(",", ":"))


NGRAM_JSON = ngram_json(4)
LLAMA = ["-t", "2", "--parallel", "32", "-c", "65536", "--alias", "SmolLM2-135M-Instruct", "--jinja"]
# name -> (server, extra arguments)
SETTINGS = {
    "off": ("tokenloom", []),
    "ngram": ("tokenloom", ["--speculative-config", NGRAM_JSON]),
    "ngram-k6": ("tokenloom", ["--speculative-config", ngram_json(6)]),
    "ngram-k8": ("tokenloom", ["--speculative-config", ngram_json(8)]),
    "ngram-k12": ("tokenloom", ["--speculative-config", ngram_json(12)]),
    "ngram-k8-min1": ("tokenloom", ["--speculative-config", ngram_json(8, lookup_min=1)]),
    "ngram-always": ("tokenloom", ["--speculative-config",
                                   json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})]),
    "llama-off": ("llama", LLAMA),
    "llama-ngram-simple": ("llama", [*LLAMA, "--spec-type", "ngram-simple"]),
    "llama-ngram-map-k": ("llama", [*LLAMA, "--spec-type", "ngram-map-k"]),
    "vllm-off": ("vllm", []),
    "vllm-ngram": ("vllm", ["--speculative-config", NGRAM_JSON]),
    "vllm-ngram-k8": ("vllm", ["--speculative-config", ngram_json(8)]),
}
CELLS = {
    "grounded": ["--endpoint", "chat", "--dataset", str(ROOT / "data/grounded.jsonl"), "--num-prompts", "20",
                 "--max-concurrency", "1", "--no-ignore-eos"],
    "free": ["--endpoint", "chat", "--dataset", str(ROOT / "data/freewrite.jsonl"), "--num-prompts", "12",
             "--max-concurrency", "1"],
    "mixed": ["--dataset", "mixed", "--num-prompts", "64", "--max-concurrency", "32", "--input-len", "128"],
}


def server_command(server: str, extra: list[str]) -> tuple[list[str], dict]:
    if server == "tokenloom":
        return [os.path.join(os.path.dirname(sys.executable), "tokenloom"), "serve", "--port", str(PORT),
                "--disable-log-requests", "--metrics-open", *extra], {}
    if server == "llama":
        from tokenloom.model.load import model_path

        binary = os.environ.get("LLAMA_BIN", os.path.join(tempfile.gettempdir(), "llamacpp/build/bin/llama-server"))
        return [binary, "-m", str(model_path(None)), "--port", str(PORT), *extra], {}
    # vLLM-CPU through the shared script (bfloat16, its fastest setting here); extra args via VLLM_PEER_ARGS.
    return (["bash", str(ROOT.parent.parent / "shared/tools/vllm_cpu_peer.sh"), "serve", str(PORT), "bfloat16"],
            {"VLLM_PEER_ARGS": " ".join(extra)})


def spec_counters() -> dict:
    """Speculation counters from /metrics (tokenloom's and vLLM's names; llama-server has none)."""
    out = {"draft_tokens": 0.0, "accepted_tokens": 0.0, "per_pos": {}}
    try:
        text = httpx.get(f"http://127.0.0.1:{PORT}/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if re.match(r"(tokenloom|vllm):spec_decode_num_draft_tokens_total", line):
            out["draft_tokens"] += float(line.split()[-1])
        elif re.match(r"(tokenloom|vllm):spec_decode_num_accepted_tokens_total", line):
            out["accepted_tokens"] += float(line.split()[-1])
        elif m := re.match(r'(tokenloom|vllm):spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)".*\} (\S+)',
                           line):
            out["per_pos"][int(m.group(2))] = out["per_pos"].get(int(m.group(2)), 0.0) + float(m.group(3))
    return out


def bench(cell_args: list[str], out: Path) -> dict:
    cmd = [os.path.join(os.path.dirname(sys.executable), "tokenloom"), "bench", "serve", "--base-url",
           f"http://127.0.0.1:{PORT}", "--no-progress", "--no-align-prompts", "--seed", "0", "--out", str(out),
           *cell_args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_cells(cells: dict[str, list[str]], prefix: Path) -> dict[str, dict]:
    """A warm-up, then each cell against the server on PORT: its figures and the speculation counters'
    change over it (results in `{prefix}-{cell}.json`)."""
    bench(["--num-prompts", "2", "--output-len", "8"], prefix.with_name("warm-up.json"))
    before, rows = spec_counters(), {}
    for cell, cell_args in cells.items():
        res = bench(cell_args, prefix.with_name(f"{prefix.name}-{cell}.json"))
        after = spec_counters()
        drafted = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        per_pos = {p: after["per_pos"][p] - before["per_pos"].get(p, 0.0) for p in after["per_pos"]}
        rows[cell] = {
            "output_tok_s": res["output_throughput"], "median_tpot_ms": res["median_tpot_ms"],
            "median_ttft_ms": res["median_ttft_ms"], "completed": res["completed"],
            "total_output_tokens": res["total_output_tokens"], "draft_tokens": drafted,
            "accepted_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else None,
            "accepted_per_pos": [per_pos[p] for p in sorted(per_pos)],
        }
        before = after
        print(f"  {cell}: {res['output_throughput']:.1f} tok/s, TPOT {res['median_tpot_ms']:.1f} ms, "
              f"drafts {drafted:.0f}, accepted {accepted:.0f}", flush=True)
    return rows


def mean_run(cell_runs: list[dict]) -> dict:
    """A cell over its runs: the mean output tok/s, each run's beside it, and the other figures from the
    run nearest the mean."""
    mean = statistics.fmean(r["output_tok_s"] for r in cell_runs)
    chosen = dict(min(cell_runs, key=lambda r: abs(r["output_tok_s"] - mean)))
    if len(cell_runs) > 1:
        chosen.update(output_tok_s=mean, output_tok_s_runs=[r["output_tok_s"] for r in cell_runs])
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results/speculative.json"))
    add_raw_dir_option(ap)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--reference", default="ngram", help="the setting every other one is compared with")
    args = ap.parse_args()
    out = Path(args.out)
    raw = raw_dir(args.raw_dir, out)
    # A setting named more than once runs that many times (e.g. off,ngram,ngram,off: drift between
    # minutes then falls on both alike); each cell reports the mean output tok/s of its runs.
    runs: dict[str, list[dict]] = {}
    for name in args.settings.split(","):
        print(f"== {name}", flush=True)
        tag = name if name not in runs else f"{name}-run{len(runs[name]) + 1}"
        cmd, env = server_command(*SETTINGS[name])
        proc = start_server(cmd, PORT, raw / f"{tag}.log", env)
        try:
            runs.setdefault(name, []).append(run_cells({c: CELLS[c] for c in args.cells.split(",")}, raw / tag))
        finally:
            stop(proc)
    rows = {name: {cell: mean_run([r[cell] for r in rs]) for cell in rs[0]} for name, rs in runs.items()}
    for name, cells in rows.items():  # each setting against its own server without speculation
        base = rows.get({"tokenloom": "off", "llama": "llama-off", "vllm": "vllm-off"}[SETTINGS[name][0]])
        for cell, r in cells.items():
            if base is not None:
                r["vs_own_off"] = r["output_tok_s"] / base[cell]["output_tok_s"]
            if name != args.reference and args.reference in rows:
                r[f"{args.reference}_vs_this"] = rows[args.reference][cell]["output_tok_s"] / r["output_tok_s"]
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    summary = {"command": " ".join(["python benchmarks/speculative.py", *sys.argv[1:]]),
               "cpu_model": cpu, "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
               "machine": platform.machine(), "settings": {k: list(SETTINGS[k]) for k in rows}, "results": rows}
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
