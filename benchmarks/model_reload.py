"""Cold and warm model loads in one multi-model server (issue 54: "a warm reload of Qwen2.5-0.5B ≤ 2 s,
cold load reported beside it").

One `tokenloom serve A B --models-max 1 --no-models-autoload` (one model resident at a time: loading
one evicts the other), its packed-weight cache in a fresh directory. `POST /models/load` of each model
in turn, `--rounds` times: the first load of each packs its weights (cold), every later one maps them
from the disk cache (warm). Each load's wall time as the client sees it (the request returns once the
model is `loaded`: weights, tokenizer, engine and its KV pool), then one greedy request to the loaded
model, its text compared with the first round's (a warm model answers as the cold one did).

    .venv/bin/python benchmarks/model_reload.py [--models smollm2-135m qwen2.5-coder-0.5b] [--rounds 3] \\
        [--out benchmarks/results/model-reload.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import start_server, stop

ROOT = Path(__file__).resolve().parent.parent
PORT = 8791


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{PORT}"
    with tempfile.TemporaryDirectory() as cache:
        cmd = [str(ROOT / ".venv/bin/tokenloom"), "serve", *args.models, "--port", str(PORT), "--models-max", "1",
               "--no-models-autoload"]
        proc = start_server(cmd, PORT, Path(cache) / "server.log", env={"TOKENLOOM_PACKED_CACHE": cache})
        times: dict[str, list[float]] = {m: [] for m in args.models}
        texts: dict[str, list[str]] = {m: [] for m in args.models}
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                # The server loaded its first model at start, packing it into the cache: unload it and
                # empty the cache, so that each model's first load below is cold.
                for model in args.models:
                    client.post("/models/unload", json={"model": model})
                for entry in Path(cache).glob("*.safetensors"):
                    entry.unlink()
                for _ in range(args.rounds):
                    for model in args.models:
                        start = time.perf_counter()
                        r = client.post("/models/load", json={"model": model})
                        times[model].append(time.perf_counter() - start)
                        r.raise_for_status()
                        r = client.post("/v1/completions", json={"model": model, "prompt": "def fibonacci(n):",
                                                                 "max_tokens": 16, "temperature": 0})
                        r.raise_for_status()
                        texts[model].append(r.json()["choices"][0]["text"])
        finally:
            stop(proc)
    lines = ["| model | cold load | warm loads (median, worst) | warm answers = cold's |", "|---|---|---|---|"]
    for model in args.models:
        cold, warm = times[model][0], times[model][1:]
        same = all(t == texts[model][0] for t in texts[model])
        lines.append(f"| {model} | {cold:.2f} s | {statistics.median(warm):.2f} s, {max(warm):.2f} s | "
                     f"{'yes' if same else 'NO'} |")
    text = "\n".join(lines) + f"\n\n{args.rounds} rounds; load average after: {os.getloadavg()[0]:.2f}\n"
    print(text)
    if args.out:
        Path(args.out).write_text("# Cold and warm model loads (multi-model server, packed-weight cache)\n\n"
                                  "    .venv/bin/python benchmarks/model_reload.py --models "
                                  f"{' '.join(args.models)} --rounds {args.rounds} --out {args.out}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
