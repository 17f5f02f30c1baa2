"""Does a long prompt stall the streams that are decoding? (issue: "a long prompt does not stall streams")

For each server setting (servers taking turns, one up at a time): 8 streams decode (128-token prompts,
ignore_eos); run A has nothing else, run B sends one 6,000-token prompt 2 s in. We report the streams'
inter-token gaps: p50/p99 over run A, and p99 over the gaps of run B that overlap the long prompt's
prefill (from its arrival to its first token), the ratio of the two, and the long prompt's TTFT.
Settings: `tokenloom serve` as shipped (stall-free batching, factor 1.5) and with --stall-free-factor 0
(fixed 512-token budget: whole chunks beside the decodes).

    .venv/bin/python benchmarks/stall_free.py [--out benchmarks/results/stall_free.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import time

import httpx
import numpy as np

from tokenloom.bench.client import LoadConfig, make_http_client, send_request
from tokenloom.bench.datasets import SampleRequest
from tokenloom.model.kernels import cpu_flags

PORT = 8131
STREAMS, STREAM_PROMPT, STREAM_TOKENS = 8, 128, 700
LONG_PROMPT, LONG_AT_S = 6000, 2.0
SETTINGS = {"stall-free 1.5 (default)": [], "fixed budget (--stall-free-factor 0)": ["--stall-free-factor", "0"]}


def token_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def start_server(extra: list[str]) -> subprocess.Popen:
    cmd = [os.path.join(os.path.dirname(sys.executable), "tokenloom"), "serve", "--port", str(PORT),
           "--disable-log-requests", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server {cmd} did not start")


def chunk_times(r) -> list[float]:
    """Absolute arrival time of each streamed chunk of one result."""
    t = r.start_time + r.ttft
    out = [t]
    for gap in r.itl:
        t += gap
        out.append(t)
    return out


async def one_run(seed: int, with_long: bool) -> dict:
    rng = random.Random(seed)
    cfg = LoadConfig(base_url=f"http://127.0.0.1:{PORT}", model="SmolLM2-135M-Instruct", show_progress=False)
    streams = [SampleRequest(token_prompt(rng, STREAM_PROMPT), STREAM_PROMPT, STREAM_TOKENS) for _ in range(STREAMS)]
    long = SampleRequest(token_prompt(rng, LONG_PROMPT), LONG_PROMPT, 1)
    async with make_http_client(None, 600) as client:
        tasks = [asyncio.create_task(send_request(client, cfg, s, {})) for s in streams]
        long_result = None
        if with_long:
            await asyncio.sleep(LONG_AT_S)
            long_result = await send_request(client, cfg, long, {})
        results = await asyncio.gather(*tasks)
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    gaps, window_gaps = [], []
    window = None
    if long_result is not None:
        assert long_result.success, long_result.error
        window = (long_result.start_time, long_result.start_time + long_result.ttft)
    for r in results:
        times = chunk_times(r)
        for a, b in itertools.pairwise(times):
            gaps.append(b - a)
            if window and b > window[0] and a < window[1]:
                window_gaps.append(b - a)
    out = {"itl_p50_ms": float(np.percentile(gaps, 50) * 1e3), "itl_p99_ms": float(np.percentile(gaps, 99) * 1e3),
           "itl_max_ms": float(max(gaps) * 1e3)}
    if long_result is not None:
        out |= {"long_prompt_ttft_s": long_result.ttft, "gaps_during_prefill": len(window_gaps),
                "itl_p99_during_prefill_ms": float(np.percentile(window_gaps, 99) * 1e3),
                "itl_max_during_prefill_ms": float(max(window_gaps) * 1e3)}
    return out


OUT = "benchmarks/results/stall_free.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    held = [f"{k}={os.environ[k]}" for k in ("TOKENLOOM_MAX_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
            if k in os.environ]  # an AVX2-only machine played on a wider one (benchmarks/peers.sh ISA=avx2)
    command = " ".join([*held, "python benchmarks/stall_free.py", *(["--out", args.out] if args.out != OUT else [])])
    report = {"command": command, "machine": platform.machine(),
              "cpu_flags": [f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))],
              "streams": STREAMS, "stream_prompt": STREAM_PROMPT, "stream_tokens": STREAM_TOKENS,
              "long_prompt": LONG_PROMPT, "long_prompt_at_s": LONG_AT_S, "settings": {}}
    for i, (name, extra) in enumerate(SETTINGS.items()):
        proc = start_server(extra)
        try:
            asyncio.run(one_run(100 + i, False))  # warm-up: the step-cost model learns this machine
            base = asyncio.run(one_run(200 + i, False))
            loaded = asyncio.run(one_run(300 + i, True))
        finally:
            proc.terminate()
            proc.wait(30)
        row = {"without_long_prompt": base, "with_long_prompt": loaded,
               "p99_ratio": loaded["itl_p99_during_prefill_ms"] / base["itl_p99_ms"]}
        report["settings"][name] = row
        print(f"{name}: p99 ITL {base['itl_p99_ms']:.1f} ms alone, {loaded['itl_p99_during_prefill_ms']:.1f} ms while "
              f"the {LONG_PROMPT}-token prompt prefills ({row['p99_ratio']:.2f}x); its TTFT "
              f"{loaded['long_prompt_ttft_s']:.2f} s", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
