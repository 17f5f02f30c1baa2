"""Time the model forward of the real bundled SmolLM2-135M (Q4_1 GGUF) under each weight format.

Cases: a decode step at batch 1 and 32 (each sequence 256 tokens of context), and a 512-token prefill
(one sequence). Variants: fp32 (today), bf16 dense, int4 weight-only from the Q4_1 blocks all in bf16,
int4 with an int8 LM head, int4 and int8 with a float32 residual stream/KV cache (bf16 only at the
matmul inputs), and (--compile) bf16 int4 with the per-layer MLP compiled.
Variants are interleaved within every repeat, so machine noise hits them all alike; we report min and
median per case. The QKV and gate/up projections are already fused at load in every variant.

    PYTHONPATH=. python benchmarks/forward_levers.py [--repeats 7] [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from tokenloom.model.decoder import DecoderModel, ForwardBatch, PrefillSpan
from tokenloom.model.kernels import cpu_flags
from tokenloom.model.loader import ModelSource, load_model
from tokenloom.model.quant.modules import Int8Linear
from tokenloom.model.quant.probe import detect

BLOCK = 16
CTX = 256  # context of every decoding sequence
PREFILL = 512


def make_caches(model: DecoderModel, num_slots: int, dtype: torch.dtype):
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    kv = (torch.randn(cfg.num_layers, 2, num_slots, cfg.num_kv_heads, cfg.dim_per_head, generator=gen) * 0.5).to(dtype)
    return [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]


def decode_batch(batch_size: int) -> tuple[torch.Tensor, ForwardBatch]:
    """Each sequence owns CTX slots; its new token sits at position CTX-1."""
    seq = torch.arange(batch_size)
    slots = seq[:, None] * CTX + torch.arange(CTX)  # [B, CTX], CTX is a multiple of BLOCK
    batch = ForwardBatch(
        positions=torch.full((batch_size,), CTX - 1),
        slot_mapping=slots[:, -1].contiguous(),
        num_decodes=batch_size,
        decode_like_rows=batch_size,
        decode_block_tables=seq[:, None] * (CTX // BLOCK) + torch.arange(CTX // BLOCK),
        decode_context_lens=torch.full((batch_size,), CTX),
        block_size=BLOCK,
        prefills=[],
        logits_indices=seq,
    )
    return (seq * 7919) % 49152, batch


def prefill_batch(n: int) -> tuple[torch.Tensor, ForwardBatch]:
    idx = torch.arange(n)
    batch = ForwardBatch(
        positions=idx,
        slot_mapping=idx,
        num_decodes=0,
        decode_like_rows=0,
        decode_block_tables=torch.empty((0, 0), dtype=torch.long),
        decode_context_lens=torch.empty(0, dtype=torch.long),
        block_size=16,
        prefills=[PrefillSpan(0, n, idx, None)],
        logits_indices=torch.tensor([n - 1]),
    )
    return (idx * 7919) % 49152, batch


def compile_mlp(model: DecoderModel) -> float:
    """torch.compile every layer's MLP (gate_up -> SiLU*up -> down); returns the compile seconds."""
    t0 = time.perf_counter()
    for layer in model.layers:
        layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)
    return time.perf_counter() - t0  # the real cost lands on the first calls (see warm-up below)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--decode-steps", type=int, default=5, help="decode steps averaged per sample")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "forward_levers.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    source = ModelSource.resolve(None)

    variants: dict[str, DecoderModel] = {}
    load_s: dict[str, float] = {}
    for name, kw in [
        ("fp32", {}),
        ("bf16", {"dtype": "bfloat16"}),
        ("int4", {"quantization": "int4", "dtype": "bfloat16"}),
        ("int4_f32res", {"quantization": "int4"}),
        ("int8_f32res", {"quantization": "int8"}),
    ]:
        t0 = time.perf_counter()
        variants[name] = load_model(source, **kw)
        load_s[name] = round(time.perf_counter() - t0, 2)
        print(f"loaded {name} in {load_s[name]} s ({variants[name].quantization})", flush=True)
    # int4 layers + int8 LM head: same int4 model with the head swapped in/out around its runs.
    head8 = Int8Linear(variants["int4"].embed_tokens.weight, torch.bfloat16)

    cases = {"decode_b1": decode_batch(1), "decode_b32": decode_batch(32), "prefill_512": prefill_batch(PREFILL)}
    caches = {dt: make_caches(variants["fp32"], 32 * CTX, dt) for dt in (torch.float32, torch.bfloat16)}

    def run(name: str, case: str) -> None:
        model = variants["int4" if name.startswith("int4+") else name]
        model.logits_proj = head8 if name in ("int4+int8head", "int4+compile") else None
        ids, batch = cases[case]
        model(ids, batch, caches[model.embed_tokens.weight.dtype])

    names = ["fp32", "bf16", "int4", "int4+int8head", "int4_f32res", "int8_f32res"]
    compile_s = None
    with torch.inference_mode():
        for name in names:
            for case in cases:
                run(name, case)
        if args.compile:
            import copy

            variants["int4c"] = copy.deepcopy(variants["int4"])
            t0 = time.perf_counter()
            compile_mlp(variants["int4c"])
            for case in cases:  # first calls compile (dynamic shapes: once per layer, not per batch size)
                m = variants["int4c"]
                m.logits_proj = head8
                m(cases[case][0], cases[case][1], caches[torch.bfloat16])
            compile_s = round(time.perf_counter() - t0, 1)
            print(f"compile (first calls) {compile_s} s", flush=True)
            names.append("int4+compile")

        samples: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in cases}
        for r in range(args.repeats):
            for case in cases:
                inner = args.decode_steps if case.startswith("decode") else 1
                for name in names:
                    if name == "int4+compile":
                        m = variants["int4c"]
                        m.logits_proj = head8
                        fn = lambda m=m, case=case: m(cases[case][0], cases[case][1], caches[torch.bfloat16])
                    else:
                        fn = lambda name=name, case=case: run(name, case)
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fn()
                    samples[case][name].append((time.perf_counter() - t0) / inner * 1e3)
            print(f"repeat {r + 1}/{args.repeats}", flush=True)

    results = {}
    for case, by_name in samples.items():
        base = statistics.median(by_name["fp32"])
        results[case] = {
            n: {
                "min_ms": round(min(v), 2),
                "median_ms": round(statistics.median(v), 2),
                "speedup_vs_fp32_median": round(base / statistics.median(v), 2),
            }
            for n, v in by_name.items()
        }
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "detect": detect(),
        "cpu_flags": [f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))],
        "decode_context": CTX,
        "repeats": args.repeats,
        "load_seconds": load_s,
        "compile_seconds": compile_s,
        "results_ms": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for case, by_name in results.items():
        print(case)
        for n, v in by_name.items():
            print(f"  {n:14s} min {v['min_ms']:8.2f}  median {v['median_ms']:8.2f}  x{v['speedup_vs_fp32_median']}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
