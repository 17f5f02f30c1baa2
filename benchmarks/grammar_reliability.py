"""Grammar reliability figures for benchmarks/reliability.md (the real model, one process):

1. the largest grammars the limits accept, and their compile time (worker + server side);
2. the worst inter-token gap 8 unconstrained streams see while the most expensive accepted grammar
   (1,999 GBNF rules, n=8) compiles off the engine thread and then runs, vs their gap before;
3. the grammar cache at its byte bound: what it counts, and the process's resident memory.

    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/grammar_reliability.py \
        [--out benchmarks/results/grammar_reliability.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from grammar_shapes import gbnf_wide, lark_chain, ref_chain

from tokenloom import EngineConfig, SamplingParams
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.structured_output.grammar import GrammarCompiler


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def largest_accepted(compiler: GrammarCompiler) -> list[dict]:
    out = []
    for name, params in [("gbnf 1,999 rules (wide)", StructuredOutputsParams(grammar=gbnf_wide(1999))),
                         ("lark chain 126 rules", StructuredOutputsParams(grammar=lark_chain(125))),
                         ("json $ref chain 126", StructuredOutputsParams(json=ref_chain(125)))]:
        start = time.monotonic()
        entry = compiler.compile(params)
        out.append({"grammar": name, "bytes": len(params.cache_key[1].encode()), "wall_s": time.monotonic() - start,
                    "worker_cpu_s": entry.compile_seconds, "first_mask_ms": entry.mask_ms,
                    "memory_bytes": entry.memory_bytes})
    return out


def gaps_while_compiling(engine: LLMEngine) -> dict:
    streams = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"s{i}", f"Stream {i} tells a long story:", streams)
    last: dict[str, float] = {}
    gaps: dict[str, list[float]] = {"before": [], "during": []}
    phase = "before"
    params = StructuredOutputsParams(grammar=gbnf_wide(1999))
    compiled = threading.Event()
    compile_time = {}

    def compile_off_thread():
        start = time.monotonic()
        engine.grammars.compile(params)
        compile_time["wall_s"] = time.monotonic() - start
        compiled.set()

    started = time.monotonic()
    thread = None
    added = False
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic()
        for out in outs:
            if out.request_id.startswith("s") and out.request_id in last:
                gaps[phase].append(now - last[out.request_id])
            last[out.request_id] = now
        if phase == "before" and now - started > 4 and thread is None:
            phase = "during"
            thread = threading.Thread(target=compile_off_thread)
            thread.start()
        if compiled.is_set() and not added:
            engine.add_request("g", "Pick:", SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=4,
                                                            structured_outputs=params))
            added = True
        if added and "g" not in engine.requests and "done_s" not in compile_time:
            compile_time["done_s"] = time.monotonic() - started
            break
    for rid in list(engine.requests):
        engine.abort_request(rid)
    gaps["during"] = gaps["during"] or [0.0]

    def p(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"normal_gap_median_s": p(gaps["before"], 0.5), "normal_gap_max_s": max(gaps["before"]),
            "during_gap_max_s": max(gaps["during"]), "during_gap_p99_s": p(gaps["during"], 0.99),
            "worst_over_normal_median": max(gaps["during"]) / p(gaps["before"], 0.5),
            "compile_wall_s": compile_time.get("wall_s"), "gaps_counted": len(gaps["during"])}


def cache_at_bound(compiler: GrammarCompiler) -> dict:
    before = rss_mb()
    n = 0
    while n < 200:
        compiler.compile(StructuredOutputsParams(regex=f"v{n}a{{30000}}"))
        n += 1
        if len(compiler._cache) < n:  # evicting: the bound is reached
            break
    more = 10
    for k in range(more):
        compiler.compile(StructuredOutputsParams(regex=f"w{k}a{{30000}}"))
    return {"bound_bytes": compiler.limits.max_grammar_cache_bytes, "cache_bytes": compiler.cache_bytes,
            "entries": len(compiler._cache), "compiled": n + more,
            "process_rss_growth_mb": rss_mb() - before}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/grammar_reliability.json")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(quantization="auto", max_model_len=2048))
    result = {"largest_accepted": largest_accepted(engine.grammars)}
    print(json.dumps(result, indent=2), flush=True)
    fresh = LLMEngine(EngineConfig(quantization="auto", max_model_len=2048))
    # The compiler's first use builds llguidance's tokenizer in this process (~0.3 s holding the GIL)
    # and starts the worker: a once-per-process cost, paid here before the streams start.
    fresh.grammars.compile(StructuredOutputsParams(choice=["warm"]))
    result["gaps"] = gaps_while_compiling(fresh)
    print(json.dumps(result["gaps"], indent=2), flush=True)
    result["cache"] = cache_at_bound(engine.grammars)
    print(json.dumps(result["cache"], indent=2), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
