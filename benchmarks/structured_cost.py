"""Cost of structured outputs: 32 concurrent requests all constrained by one JSON schema vs 32
unconstrained ones, on the real model, runs interleaved (A B A B ...) in one process.

Three arms: unconstrained; constrained with jump-forward switched off, so every step is one decode
token per sequence and the ratio of mean step times is the grammar's own cost (target <= 1.15x:
bitmask fill, unpack and masking); constrained as served (jump-forward on: forced tokens are
computed as chunks, so steps are longer but there are far fewer; its time per generated token is
the figure that matters). Also: grammars compiled after warm-up (0: one cached grammar for all 32
requests and every repeat) and the bitmask fill time per row.

    .venv/bin/python benchmarks/structured_cost.py [--repeats 3] [--out benchmarks/results/structured_cost.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from tokenloom import EngineConfig, SamplingParams
from tokenloom.engine.constraints import RequestConstraints
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.structured_output.grammar import GrammarState

SCHEMA = {
    "type": "object",
    "properties": {
        "readings": {"type": "array", "minItems": 6, "maxItems": 6, "items": {
            "type": "object",
            "properties": {"station": {"type": "string", "maxLength": 10},
                           "value": {"type": "integer", "minimum": 0, "maximum": 999},
                           "ok": {"type": "boolean"}},
            "required": ["station", "value", "ok"], "additionalProperties": False}},
    },
    "required": ["readings"], "additionalProperties": False,
}
BATCH = 32


def run(engine: LLMEngine, constrained: bool, tag: str) -> dict:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Report six station readings."}])
    for i in range(BATCH):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=160, ignore_eos=not constrained,
                                structured_outputs={"json": SCHEMA} if constrained else None)
        engine.add_request(f"{tag}-{i}", prompt, params)
    durations: list[float] = []
    tokens, total = 0, 0.0
    first = True
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        total += elapsed  # the whole run, prompts included: time per generated token
        if not first and engine.last_step.num_seqs == BATCH:  # all 32 generating (the first step is the prompts)
            durations.append(elapsed)
        first = False
        tokens += sum(len(c.token_ids) for o in outs if o.finished for c in o.outputs)
    return {"steps": len(durations), "step_mean_s": statistics.fmean(durations), "tokens": tokens,
            "s_per_token": total / tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/structured_cost.json")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(max_num_seqs=BATCH, max_num_batched_tokens=2048, enable_prefix_caching=False))
    mask_time = [0.0, 0]
    fill = GrammarState.fill_bitmask

    def timed_fill(self, row):
        t = time.perf_counter()
        fill(self, row)
        mask_time[0] += time.perf_counter() - t
        mask_time[1] += 1

    GrammarState.fill_bitmask = timed_fill
    forced_tokens = RequestConstraints.forced_tokens
    results: dict[str, list[dict]] = {"unconstrained": [], "constrained_no_jump_forward": [], "constrained": []}
    run(engine, True, "warm")
    compiled_before = engine.grammars.num_compiled
    for r in range(args.repeats):
        results["unconstrained"].append(run(engine, False, f"u{r}"))
        RequestConstraints.forced_tokens = lambda self, seq: []
        results["constrained_no_jump_forward"].append(run(engine, True, f"n{r}"))
        RequestConstraints.forced_tokens = forced_tokens
        results["constrained"].append(run(engine, True, f"c{r}"))

    def median(arm: str, key: str) -> float:
        return statistics.median(x[key] for x in results[arm])

    u, c, j = (median(a, "step_mean_s") for a in results)
    ut, ct, jt = (median(a, "s_per_token") for a in results)
    summary = {
        "command": f"python benchmarks/structured_cost.py --repeats {args.repeats}",
        "cpu": platform.processor() or platform.machine(),
        "batch": BATCH,
        "step_time_unconstrained_s": u,
        "step_time_constrained_no_jump_forward_s": c,
        "step_time_ratio_grammar_cost": c / u,
        "time_per_token_ratio_no_jump_forward": ct / ut,
        "step_time_constrained_with_jump_forward_s": j,
        "time_per_token_ratio_with_jump_forward": jt / ut,
        "bitmask_fill_ms_per_row": 1000 * mask_time[0] / max(mask_time[1], 1),
        "grammars_compiled_after_warmup": engine.grammars.num_compiled - compiled_before,
        "runs": results,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
