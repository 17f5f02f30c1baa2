"""Multi-LoRA serving on SmolLM2 behind `tokenloom serve`: throughput with adapters against the base.

Adapters: rank 16 on all seven projections, seeded random, made with `peft` (as tests/test_lora_server.py
makes them). Servers take turns, one start per setting and round (`--repeats`, 3 by default: a setting's
figure is the median of its rounds; each round's ratio to that round's base is kept too). The same
workload each time: 64 requests of the mixed workload (128-token prompts, outputs alternating 16 / 256,
ignore_eos), 32 concurrent.
- base: `--enable-lora` server, every request to the base model;
- 1 adapter: every request through one adapter;
- 8 adapters: requests round-robin over 8 adapters (`--max-loras 8`);
then, on the 8-adapter server: loading a 9th adapter at run time while 8 streams decode (its latency and
the streams' p99 inter-token gap before and during), and the server's RSS with 8, then 64 adapters
registered (`--max-cpu-loras 64`). `--servers tokenloom,vllm` also runs vLLM-CPU (bf16, its best setting
here; ../shared/tools/vllm_cpu_peer.sh) on the same adapters and workload for base / 1 / 8 adapters.

    .venv/bin/python benchmarks/lora.py [--out benchmarks/results/lora.json] [--quantization auto]
                                         [--servers tokenloom,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from server_process import start_server, stop

from tokenloom.bench.client import LoadConfig, make_http_client, send_request
from tokenloom.bench.datasets import load_samples

PORT = 8137
ROOT = Path(__file__).resolve().parent
BASE = "SmolLM2-135M-Instruct"


def make_adapters(root: Path, n: int) -> list[Path]:
    sys.path.insert(0, str(ROOT.parent / "tests"))
    from test_lora_server import make_smollm2_adapter  # one recipe for the tests and the benchmark

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    paths = []
    for i in range(n):
        path = root / f"a{i}"
        if not path.exists():
            make_smollm2_adapter(path, seed=100 + i, targets=targets, rank=16)
        paths.append(path)
    return paths


def tokenloom_serve(args: list[str]) -> list[str]:
    return [os.path.join(os.path.dirname(sys.executable), "tokenloom"), "serve", "--port", str(PORT),
            "--disable-log-requests", "--served-model-name", BASE, *args]


def vllm_serve(lora_args: list[str]) -> tuple[list[str], dict]:
    """vLLM-CPU on the bundled SmolLM2 (converted to an HF directory by the peer script's setup)."""
    peer = ROOT.parent.parent / "shared" / "tools" / "vllm_cpu_peer.sh"
    return (["bash", str(peer), "serve", str(PORT), "bfloat16"],
            {"VLLM_PEER_ARGS": " ".join(["--enable-lora", "--max-lora-rank", "16", *lora_args]),
             "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


async def load(models: list[str], num_prompts: int = 64, concurrency: int = 32) -> dict:
    samples = load_samples("mixed", num_prompts, input_len=128, seed=0)
    cfgs = {m: LoadConfig(base_url=f"http://127.0.0.1:{PORT}", model=m, show_progress=False) for m in set(models)}
    sem = asyncio.Semaphore(concurrency)

    async def one(i, sample, client):
        async with sem:
            return await send_request(client, cfgs[models[i % len(models)]], sample, {})

    async with make_http_client(concurrency, 600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, s, client) for i, s in enumerate(samples)))
        wall = time.perf_counter() - start
    assert all(r.success for r in results), [r.error for r in results if not r.success][:3]
    tokens = sum(r.output_tokens for r in results)
    itl = [g for r in results for g in r.itl]
    return {"output_tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
            "p99_itl_ms": float(np.percentile(itl, 99) * 1e3) if itl else None}


async def load_during_streams(adapter: Path) -> dict:
    """8 streams decode; 2 s in, a new adapter is loaded. The streams' gaps before it and while it loads."""
    samples = load_samples("random", 8, input_len=128, output_len=400, seed=1)
    cfg = LoadConfig(base_url=f"http://127.0.0.1:{PORT}", model=BASE, show_progress=False)
    async with make_http_client(16, 600) as client:
        tasks = [asyncio.create_task(send_request(client, cfg, s, {})) for s in samples]
        await asyncio.sleep(2.0)
        t0 = time.perf_counter()
        r = await client.post(f"http://127.0.0.1:{PORT}/v1/load_lora_adapter",
                              json={"lora_name": "late", "lora_path": str(adapter)})
        t1 = time.perf_counter()
        results = await asyncio.gather(*tasks)
    assert r.status_code == 200, r.text
    before, during = [], []
    for res in results:
        t = res.start_time + res.ttft
        for gap in res.itl:
            t += gap
            (during if t0 <= t <= t1 + 0.05 else before if t < t0 else []).append(gap)
    return {"load_s": t1 - t0, "p99_itl_before_ms": float(np.percentile(before, 99) * 1e3),
            "max_itl_during_ms": float(max(during) * 1e3) if during else None, "gaps_during": len(during)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results/lora.json"))
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--servers", default="tokenloom", help="comma-separated: tokenloom, vllm")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the settings (the median is reported)")
    args = ap.parse_args()
    work = Path(tempfile.gettempdir()) / "tokenloom-lora-bench"
    work.mkdir(exist_ok=True)
    adapters = make_adapters(work, 64)
    common = ["--quantization", args.quantization, "--enable-lora", "--max-lora-rank", "16"]
    modules = [f"a{i}={p}" for i, p in enumerate(adapters[:8])]
    servers = args.servers.split(",")
    out: dict = {"command": "python benchmarks/lora.py" + (f" --quantization {args.quantization}"
                                                           if args.quantization != "auto" else "")
                 + (f" --servers {args.servers}" if servers != ["tokenloom"] else "")
                 + (f" --repeats {args.repeats}" if args.repeats != 3 else ""),
                 "machine": platform.machine(), "results": {}}
    settings = {"base": (["--max-loras", "1"], [BASE]),
                "1 adapter": (["--max-loras", "1", "--lora-modules", modules[0]], ["a0"]),
                "8 adapters": (["--max-loras", "8", "--lora-modules", *modules], [f"a{i}" for i in range(8)])}
    for server in servers:
        results = out["results"] if server == "tokenloom" else out.setdefault("peers", {}).setdefault(server, {})
        # Rounds over the settings, each server started anew: a setting's figure is its median over the
        # rounds (one run of this cell moved by up to 1.4x with the same code).
        for round_ in range(args.repeats):
            for name, (extra, models) in settings.items():
                if server == "tokenloom":
                    more = ["--allow-runtime-lora-updating", "--max-cpu-loras", "64"] if name == "8 adapters" else []
                    cmd, env = tokenloom_serve(common + extra + more), None
                else:
                    cmd, env = vllm_serve(extra)
                proc = start_server(cmd, PORT, work / f"{server}-{name.replace(' ', '-')}.log", env)
                try:
                    asyncio.run(load([models[0]], num_prompts=2))  # warm-up
                    res = asyncio.run(load(models))
                    if round_ == 0:
                        res["rss_mb"] = rss_mb(proc.pid)
                    if round_ == 0 and name == "8 adapters" and server == "tokenloom":
                        res["load_while_streaming"] = asyncio.run(load_during_streams(adapters[8]))
                        with httpx.Client(timeout=600) as c:
                            for i, p in enumerate(adapters[9:], start=9):
                                r = c.post(f"http://127.0.0.1:{PORT}/v1/load_lora_adapter",
                                           json={"lora_name": f"a{i}", "lora_path": str(p)})
                                assert r.status_code == 200, r.text
                        res["rss_mb_64_adapters"] = rss_mb(proc.pid)
                    kept = results.setdefault(name, {**res, "runs_tok_s": []})
                    kept["runs_tok_s"].append(res["output_tok_s"])
                    kept["output_tok_s"] = float(np.median(kept["runs_tok_s"]))
                    print(server, name, f"round {round_ + 1}", json.dumps(res), flush=True)
                finally:
                    stop(proc)
        base = results["base"]["output_tok_s"]
        for res in results.values():
            res["vs_base"] = res["output_tok_s"] / base
            res["vs_base_per_round"] = [t / b for t, b in zip(res["runs_tok_s"], results["base"]["runs_tok_s"],
                                                                strict=True)]
    if "vllm" in out.get("peers", {}) and out["results"]:
        out["vs_vllm"] = {name: res["output_tok_s"] / out["peers"]["vllm"][name]["output_tok_s"]
                          for name, res in out["results"].items()}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
