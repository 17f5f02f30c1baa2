"""Speculation with a draft model: Qwen2.5-Coder-1.5B served with the 0.5B drafting, behind a server.

Servers take turns (one up at a time) on the same GGUF files (the catalog's; `tokenloom pull` them
first), measured by `tokenloom bench serve` (greedy, streaming) in two cells:
- code: c=1 code completion, benchmarks/data/code.jsonl (12 function headers with docstrings), up to
  128 tokens, ends at EOS;
- mixed: 64 requests, 32 concurrent, outputs alternating 16 / 256 (never a loss: >= 0.97x off).
Acceptance per draft position comes from /metrics after each cell (benchmarks/speculative.py).

Peers: llama.cpp's `llama-server` without and with `--model-draft` (`--spec-type draft-simple`, the same
two files): its default depth (3) and 4, tokenloom's.

    .venv/bin/python benchmarks/draft_model.py [--settings off,draft,llama-off,llama-draft]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from raw_runs import add_raw_dir_option, raw_dir
from server_process import start_server, stop
from speculative import PORT, run_cells

from tokenloom.model import catalog
from tokenloom.model.kernels import cpu_flags

ROOT = Path(__file__).resolve().parent
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
DRAFT_JSON = json.dumps({"model": DRAFT, "num_speculative_tokens": 4}, separators=(",", ":"))
LLAMA = ["-t", "2", "--parallel", "32", "-c", "32768", "--alias", TARGET]
SETTINGS = {
    "off": ("tokenloom", []),
    "draft": ("tokenloom", ["--speculative-config", DRAFT_JSON]),
    "draft-always": ("tokenloom", ["--speculative-config", json.dumps({"model": DRAFT, "num_speculative_tokens": 4,
                                                                       "adaptive": False})]),
    "llama-off": ("llama", LLAMA),
    "llama-draft": ("llama", [*LLAMA, "--model-draft", "{draft}", "--spec-type", "draft-simple", "-td", "2"]),
    "llama-draft4": ("llama", [*LLAMA, "--model-draft", "{draft}", "--spec-type", "draft-simple", "-td", "2",
                               "--spec-draft-n-max", "4"]),
}
CELLS = {
    "code": ["--dataset", str(ROOT / "data/code.jsonl"), "--num-prompts", "12", "--max-concurrency", "1",
             "--no-ignore-eos"],
    "mixed": ["--dataset", "mixed", "--num-prompts", "64", "--max-concurrency", "32", "--input-len", "128"],
}


def server_command(server: str, extra: list[str]) -> list[str]:
    target, draft = str(catalog.resolve(TARGET)), str(catalog.resolve(DRAFT))
    if server == "tokenloom":
        return [os.path.join(os.path.dirname(sys.executable), "tokenloom"), "serve", target, "--port", str(PORT),
                "--served-model-name", TARGET, "--disable-log-requests", "--metrics-open", *extra]
    binary = os.environ.get("LLAMA_BIN", os.path.join(tempfile.gettempdir(), "llamacpp/build/bin/llama-server"))
    return [binary, "-m", target, "--port", str(PORT), *(a.format(draft=draft) for a in extra)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results/draft_model.json"))
    add_raw_dir_option(ap)
    ap.add_argument("--settings", default="off,draft,llama-off,llama-draft")
    args = ap.parse_args()
    out = Path(args.out)
    raw = raw_dir(args.raw_dir, out)
    rows: dict[str, dict] = {}
    for name in args.settings.split(","):
        print(f"== {name}", flush=True)
        proc = start_server(server_command(*SETTINGS[name]), PORT, raw / f"{name}.log")
        try:
            rows[name] = run_cells(CELLS, raw / name)
        finally:
            stop(proc)
    for name, cells in rows.items():  # each setting against its own server without speculation
        base = rows.get({"tokenloom": "off", "llama": "llama-off"}[SETTINGS[name][0]])
        for cell, r in cells.items():
            if base is not None:
                r["vs_own_off"] = r["output_tok_s"] / base[cell]["output_tok_s"]
            if "draft" in rows and name != "draft":
                r["draft_vs_this"] = rows["draft"][cell]["output_tok_s"] / r["output_tok_s"]
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    summary = {"command": f"python benchmarks/draft_model.py --settings {args.settings}", "cpu_model": cpu,
               "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
               "machine": platform.machine(), "settings": {k: list(SETTINGS[k]) for k in rows}, "results": rows}
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
