"""One long prompt on Gemma 3 270M as served (quantization auto): the time to prefill 3,000 tokens and
write 64, and the process's peak RSS around it. Run on two checkouts to compare them (the tokens must
be the same):

    .venv/bin/python benchmarks/long_prompt.py --label after --out benchmarks/results/long_prompt.json
    git worktree add /tmp/before REV && PYTHONPATH=/tmp/before .venv/bin/python benchmarks/long_prompt.py \\
        --label before --out benchmarks/results/long_prompt.json

Each run adds its label's entry to the output file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import time
from pydoc_data import topics

import tokenloom
from tokenloom import LLM, SamplingParams
from tokenloom.model import catalog


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default="benchmarks/results/long_prompt.json")
    args = ap.parse_args()
    llm = LLM(model=str(catalog.pull(args.model, progress=False, log=lambda _: None)), quantization="auto")
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))  # from outside the repository
    ids = llm.tokenizer.encode(text)[: args.prompt_tokens]
    llm.generate([{"prompt_token_ids": ids[:100]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    before = peak_rss_mib()
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=args.output_tokens,
                                                                   ignore_eos=True), use_tqdm=False)
    checkout = os.path.dirname(os.path.dirname(tokenloom.__file__))  # the code that ran (PYTHONPATH's, if set)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=checkout).stdout.strip()
    entry = {"seconds": round(time.perf_counter() - start, 2), "peak_rss_mib_before": round(before),
             "peak_rss_mib": round(peak_rss_mib()), "tokens": out[0].outputs[0].token_ids, "commit": commit}
    print(args.label, {k: v for k, v in entry.items() if k != "tokens"})
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results.update({"model": args.model, "prompt_tokens": len(ids), "output_tokens": args.output_tokens,
                    "cpu": platform.processor() or platform.machine(), args.label: entry})
    if "before" in results and "after" in results:
        results["same_tokens"] = results["before"]["tokens"] == results["after"]["tokens"]
        results["speedup"] = round(results["before"]["seconds"] / results["after"]["seconds"], 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
