"""What releasing the blocks behind Gemma 3's sliding windows buys: the same KV memory holds more
long sequences at once.

Gemma 3 270M (15 of its 18 layers see only the last 512 positions) serves 8 requests of ~1,500-token
prompts under a fixed KV budget, twice in one process: as built (a sliding group's table releases
the blocks behind its window, engine/kv_cache.py) and with every group keeping every block (the
cache as it was before: same block pool, same layout). Reported per arm: the most sequences
running at once, preemptions, the most KV blocks one sequence held, wall time; and whether the
greedy tokens are the same in both arms (they must be: released blocks are never read).

    .venv/bin/python benchmarks/sliding_window_kv.py [--kv-mib 64] [--out benchmarks/results/sliding_window_kv.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pydoc_data import topics

from tokenloom import EngineConfig, SamplingParams
from tokenloom.engine.kv_cache import held_blocks
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model import catalog

MODEL = "gemma-3-270m"
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 1500, 64


def prompts(engine: LLMEngine) -> list[list[int]]:
    """Natural text from outside the repository (CPython's documentation topics), cut to length."""
    names = sorted(topics.topics)
    out = []
    for i in range(REQUESTS):
        text = "\n\n".join(topics.topics[n] for n in names[i * 7 : i * 7 + 40])
        out.append(engine.tokenizer.encode(text)[:PROMPT_TOKENS])
    return out


def run(engine: LLMEngine, ids: list[list[int]], tag: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    preempted = engine.scheduler.num_preemptions
    most_running = most_held = 0
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        running = engine.scheduler.running
        most_running = max(most_running, len(running))
        most_held = max([most_held] + [len(held_blocks(s)) for s in running])
    return {"wall_s": round(time.perf_counter() - start, 2), "most_running": most_running,
            "preemptions": engine.scheduler.num_preemptions - preempted, "most_blocks_one_sequence": most_held,
            "tokens": [tokens[f"{tag}-{i}"] for i in range(len(ids))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/sliding_window_kv.json")
    args = ap.parse_args()
    path = str(catalog.pull(MODEL, progress=False, log=lambda _: None))
    engine = LLMEngine(EngineConfig(model=path, quantization="auto", kv_cache_memory_bytes=args.kv_mib << 20,
                                    max_num_batched_tokens=512, enable_prefix_caching=False))
    ids = prompts(engine)
    windows = engine.kv.windows
    run(engine, [ids[0][:600]], "warm")
    arms = {}
    for arm, kv_windows in [("released", windows), ("kept", (None,) * len(windows))]:
        engine.kv.windows = kv_windows  # the pool and layout stay: only the tables' release changes
        arms[arm] = run(engine, ids, arm)
    same = arms["released"]["tokens"] == arms["kept"]["tokens"]
    summary = {
        "command": f"python benchmarks/sliding_window_kv.py --kv-mib {args.kv_mib}",
        "cpu": platform.processor() or platform.machine(),
        "model": MODEL, "requests": REQUESTS, "prompt_tokens": [len(p) for p in ids], "output_tokens": OUTPUT_TOKENS,
        "kv_mib": args.kv_mib, "kv_blocks": engine.kv.num_blocks, "block_size": engine.kv.block_size,
        "kv_groups": [("full" if w is None else f"window {w}") for w in windows],
        "same_greedy_tokens": same,
        **{arm: {k: v for k, v in r.items() if k != "tokens"} for arm, r in arms.items()},
    }
    print(json.dumps(summary, indent=2))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    if not same:
        raise SystemExit("the greedy tokens differ between the arms")


if __name__ == "__main__":
    main()
