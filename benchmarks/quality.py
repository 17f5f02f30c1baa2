"""The serving default's quality on each catalog model and ISA (issue 58: "perplexity within 1% of
float32 on natural text, top-1 ≥ 98%, KL ≤ 0.02"), and int8 KV against float16 KV on each.

For every catalog model: one prefill over ≥ 2,000 tokens of natural English (the Python documentation's
topics, shipped with every CPython), teacher-forced, through
- float32 (the file's weights dequantized: the reference),
- the serving default (`quantization="auto"`: int4 weights with the C kernels, float16 KV cache) as this
  CPU runs it, and as an AVX2-only CPU does (`TOKENLOOM_MAX_ISA=avx2` at load: the AVX2 kernels on every
  row, checked, and no bfloat16 copy for long chunks; the fast-path tests' `avx2_kernel`),
- the serving default over an int8 KV cache (`--kv-cache-dtype int8`), against the float16-KV one.
Per cell: top-1 agreement with the reference's argmax, mean KL(ref ‖ cell) in nats, and perplexity
(of the text's own next tokens) against the reference's. Quality only, no timing: it may run beside
tests, but it takes every core, so never beside a timed benchmark.

    .venv/bin/python benchmarks/quality.py [--models ...] [--out benchmarks/results/quality.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the fast-path tests' own helpers
from test_fast_paths import avx2_kernel, teacher_forced_hidden

from tokenloom.model import catalog
from tokenloom.model.loader import ModelSource, load_model
from tokenloom.model.tokenizer import load_tokenizer

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"]
POSITIONS = 2048


def natural_ids(tokenizer) -> torch.Tensor:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:40000]
    ids = tokenizer.encode(text)[:POSITIONS]
    assert len(ids) >= 2000, len(ids)
    return torch.tensor(ids)


def compare(ref_hidden, ref_model, hidden, model, ids, chunk: int = 256) -> dict:
    """top-1 agreement, mean KL(ref ‖ this) and the perplexity ratio over every position."""
    agree, kl, nll_ref, nll = 0, 0.0, 0.0, 0.0
    targets = ids[1:]
    with torch.inference_mode():
        for i in range(0, len(ids), chunk):
            ref = F.log_softmax(ref_model.compute_logits(ref_hidden[i : i + chunk]).float(), -1)
            got = F.log_softmax(model.compute_logits(hidden[i : i + chunk]).float(), -1)
            agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
            kl += (ref.exp() * (ref - got)).sum().item()
            t = targets[i : i + chunk]
            nll_ref -= ref[: len(t)].gather(1, t[:, None]).sum().item()
            nll -= got[: len(t)].gather(1, t[:, None]).sum().item()
    n = len(ids)
    return {"top1": agree / n, "kl": kl / n, "ppl_ratio": math.exp((nll - nll_ref) / (n - 1))}


def measure(name: str) -> dict:
    path = str(catalog.pull(name, progress=False))
    source = ModelSource.resolve(path)
    ids = natural_ids(load_tokenizer(path))
    ref = load_model(source)
    ref_hidden = teacher_forced_hidden(ref, ids)
    out: dict = {"positions": len(ids)}
    served = load_model(source, quantization="auto")
    served_hidden = teacher_forced_hidden(served, ids)
    out["native"] = {**compare(ref_hidden, ref, served_hidden, served, ids), "plan": served.plan.line()}
    kv8 = load_model(source, quantization="auto", kv_cache_dtype="int8")
    out["int8_kv_vs_float16_kv"] = {**compare(served_hidden, served, teacher_forced_hidden(kv8, ids), kv8, ids),
                                    "plan": kv8.plan.line()}
    del kv8, served, served_hidden
    avx2 = avx2_kernel(lambda: load_model(source, quantization="auto"))  # None unless every row takes the AVX2 kernels
    out["avx2"] = ({**compare(ref_hidden, ref, teacher_forced_hidden(avx2, ids), avx2, ids), "plan": avx2.plan.line()}
                   if avx2 is not None else None)
    return out


def markdown(rec: dict, command: str) -> str:
    lines = ["# Quality of the serving default per catalog model and ISA (benchmarks/quality.py)", "",
             f"    {command}", "", f"{rec['machine']}; {rec['when']}", "",
             "| model | cell | positions | top-1 | mean KL (nats) | perplexity / reference's |", "|---|---|---|---|---|---|"]
    for name, r in rec["models"].items():
        for cell, label in (("native", "int4 (this CPU) vs float32"), ("avx2", "int4 (AVX2 kernels) vs float32"),
                            ("int8_kv_vs_float16_kv", "int8 KV vs float16 KV")):
            c = r[cell]
            if c is None:
                lines.append(f"| {name} | {label} | | not measured: the AVX2 kernels do not run here | | |")
                continue
            lines.append(f"| {name} | {label} | {r['positions']} | {c['top1']:.4f} | {c['kl']:.5f} | "
                         f"{c['ppl_ratio']:.4f} |")
    lines += ["", "Plans:", ""]
    for name, r in rec["models"].items():
        for cell in ("native", "avx2", "int8_kv_vs_float16_kv"):
            if r[cell] is not None:
                lines.append(f"- {name} {cell}: `{r[cell]['plan']}`")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rec = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "when": time.strftime("%Y-%m-%d %H:%M"), "models": {}}
    for name in args.models:
        started = time.perf_counter()
        rec["models"][name] = measure(name)
        print(f"{name} ({time.perf_counter() - started:.0f} s): {json.dumps(rec['models'][name])[:400]}", flush=True)
    text = markdown(rec, "python benchmarks/quality.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
