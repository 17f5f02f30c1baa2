"""Offline throughput on the real bundled model: continuous batching vs one request at a time.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 64] [--input-len 128] [--output-len 128]

Runs the same 64 prompts (~128 tokens in, 128 out, ignore_eos) through one engine with
`max_num_seqs=64` and with `max_num_seqs=1`, both in float32 on the same loaded weights, and prints
output tokens/s for each and the ratio. Then single-request decode tokens/s in float32 and bfloat16.
Writes benchmarks/results/offline_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace

import torch

from tokenloom import LLM, EngineConfig, SamplingParams
from tokenloom.bench.replay import replay
from tokenloom.bench.workload import WorkloadRequest, make_workload
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model.loader import ModelSource, bundled_model_path, load_model
from tokenloom.model.tokenizer import load_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read().split("flags")[1].split("\n")[0]
    except (OSError, IndexError):
        return platform.processor()
    return " ".join(sorted(f for f in flags.split() if f.startswith(("avx512_bf16", "avx512f", "avx2", "amx"))))


def run(llm: LLM, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def decode_rate(model, tokenizer, dtype: str, request: WorkloadRequest, n: int) -> float:
    """Single-request decode tokens/s: tokens after the first over the time between first and last token."""
    engine = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=1), model=model, tokenizer=tokenizer)
    itl = replay(engine, [replace(request, max_tokens=n)]).requests[0].itl
    return len(itl) / sum(itl)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "offline_throughput"))
    args = ap.parse_args()

    path = bundled_model_path()
    tokenizer = load_tokenizer(path)
    model = load_model(ModelSource.resolve(path), dtype="float32")
    workload = make_workload("uniform", args.num_prompts, args.input_len, args.output_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    results = {}
    for name, max_num_seqs in (("continuous", args.num_prompts), ("max_num_seqs=1", 1)):
        engine = LLMEngine(EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
                           model=model, tokenizer=tokenizer)
        elapsed, tokens = run(LLM(engine=engine), prompts, params)
        results[name] = {"seconds": round(elapsed, 2), "output_tokens": tokens, "output_tok_s": round(tokens / elapsed, 2)}
        print(f"{name:>16}: {tokens} output tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tok/s", flush=True)
    ratio = results["continuous"]["output_tok_s"] / results["max_num_seqs=1"]["output_tok_s"]
    print(f"ratio continuous / max_num_seqs=1: {ratio:.2f}x")

    decode = {"float32": decode_rate(model, tokenizer, "float32", workload[0], args.decode_tokens)}
    del model
    bf16 = load_model(ModelSource.resolve(path), dtype="bfloat16")
    decode["bfloat16"] = decode_rate(bf16, tokenizer, "bfloat16", workload[0], args.decode_tokens)
    for dtype, rate in decode.items():
        print(f"single-request decode {dtype}: {rate:.1f} tok/s")

    report = {
        "command": "python benchmarks/offline_throughput.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "cpu_flags": cpu_flags(),
                    "torch": torch.__version__},
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len},
        "throughput": results,
        "ratio_continuous_over_batch1": round(ratio, 2),
        "single_request_decode_tok_s": {k: round(v, 2) for k, v in decode.items()},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Offline throughput\n\nCommand: `{report['command']}` ({report['date']}, "
                f"{report['machine']['cpus']} CPUs, {report['machine']['cpu_flags']}, torch {torch.__version__})\n\n")
        f.write("| engine | output tokens | seconds | output tok/s |\n|---|---|---|---|\n")
        for name, r in results.items():
            f.write(f"| {name} | {r['output_tokens']} | {r['seconds']} | {r['output_tok_s']} |\n")
        f.write(f"\n**Continuous / max_num_seqs=1: {ratio:.2f}x**\n\nSingle-request decode: "
                + ", ".join(f"{k} {v:.1f} tok/s" for k, v in decode.items()) + "\n")


if __name__ == "__main__":
    main()
