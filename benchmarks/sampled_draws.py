"""Sampled decoding at 32 streams, in-process on the bundled SmolLM2 as served (`--quantization auto`):
the sampler's noise from numpy (model/sampler.py's `_draw` now) against torch's `exponential_` (its
draw before), alternating on one loaded engine. Each sampled row draws one Exp(1) per vocabulary entry
(49,152 here); torch's took ~1.26 ms a row on the Zen 3 where numpy's takes ~0.27.

    .venv/bin/python benchmarks/sampled_draws.py [--rounds 3] [--out benchmarks/results/sampled-draws.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.model.kernels import cpu_flags
from tokenloom.model.sampler import Sampler

ROOT = Path(__file__).resolve().parent
ANIMALS = ["cat", "dog", "fox", "owl", "bee", "ant", "elk", "yak", "ram", "hen", "cod", "eel", "bat", "doe", "emu", "gnu"] * 2
TORCH_NOISE = torch.Generator().manual_seed(0)  # the sampler's unseeded stream before
PROMPTS = [f"Write a short story about a {a} who finds a map." for a in ANIMALS]


def torch_draw(self, probs: torch.Tensor, generator: np.random.Generator | None) -> int:
    """The draw as it was: unseeded noise from torch's `exponential_`."""
    if generator is not None:
        return numpy_draw(self, probs, generator)
    noise = torch.empty_like(probs).exponential_(generator=TORCH_NOISE)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return int((probs / noise).argmax())


numpy_draw = Sampler._draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results/sampled-draws.json"))
    args = ap.parse_args()
    llm = LLM(quantization="auto", enable_prefix_caching=False, max_num_seqs=len(PROMPTS))
    params = SamplingParams(temperature=0.8, max_tokens=128, ignore_eos=True)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, max_tokens=8), use_tqdm=False)  # warm-up
    tok_s: dict[str, list[float]] = {"torch": [], "numpy": []}
    for _ in range(args.rounds):
        for name, draw in (("torch", torch_draw), ("numpy", numpy_draw)):
            Sampler._draw = draw
            start = time.perf_counter()
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tok_s[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
            print(f"{name}: {tok_s[name][-1]:.1f} tok/s", flush=True)
    Sampler._draw = numpy_draw
    ratios = [n / t for t, n in zip(tok_s["torch"], tok_s["numpy"], strict=True)]
    summary = {"command": " ".join(["python benchmarks/sampled_draws.py", *sys.argv[1:]]),
               "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
               "streams": len(PROMPTS), "temperature": params.temperature, "max_tokens": params.max_tokens,
               "output_tok_s": tok_s, "numpy_over_torch": ratios, "median_ratio": statistics.median(ratios)}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"numpy / torch output tok/s, per round: {', '.join(f'{r:.2f}x' for r in ratios)}; "
          f"median {summary['median_ratio']:.2f}x")


if __name__ == "__main__":
    main()
