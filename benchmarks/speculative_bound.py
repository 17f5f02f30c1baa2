"""How far prompt-lookup speculation could go on issue 23's grounded cell (c=1, bar 1.8x output tok/s),
measured in-process on the bundled SmolLM2 as served (`--quantization auto`), greedy, no prefix cache:

1. every prompt of benchmarks/data/grounded.jsonl without speculation: its prefill time and its answer;
2. the same with benchmarks/speculative.py's n-gram setting (k = `--max-drafts`, at most 14): what a decode
   step costs by the rows it scores (1 + its drafts), and the speedup the engine really gets here;
3. replayed on those answers with those step costs: the time each proposer's steps would take,
   - `lookup-k`: tokenloom's lookup (engine/speculation.py's NgramProposer), always k drafts;
   - `lookup-oracle`: copies from whichever earlier place of the prompt or answer (after a 1-token
     match) continues correctly the longest, and drafts exactly the tokens that will be accepted, up to
     `--max-drafts` (8): no prompt-lookup proposer drafting that deep can do better, however it picks
     the place or the depth;
   - `perfect-k`: k drafts that are always right and cost nothing to make (a draft model that is the
     target and free).
Each line's ratio is issue 23's: (prefill + decode without speculation) / (prefill + decode with it);
step costs from 2 rows on are a line fitted to the measured ones (`step_costs`).
Step costs are measured only up to 1 + `--max-drafts` rows (the n-gram run drafts that deep), so no
replay drafts more.

    .venv/bin/python benchmarks/speculative_bound.py [--max-drafts 8] [--out benchmarks/results/speculative-bound.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from tokenloom import LLM, SamplingParams
from tokenloom.config import SpeculativeConfig
from tokenloom.engine.speculation import NgramProposer
from tokenloom.model.kernels import cpu_flags
from tokenloom.model.sampler import verify

ROOT = Path(__file__).resolve().parent
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run(prompts: list[dict], speculative_config: dict | None) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """Each prompt alone, greedy: [(prompt ids, answer ids)] and the steps' times (prefill seconds; decode
    step durations by rows)."""
    llm = LLM(quantization="auto", enable_prefix_caching=False, speculative_config=speculative_config)
    warm_up = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompts[0]["prompt"]}], True)
    llm.generate(warm_up, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)  # first-call costs
    engine, steps = llm.engine, {"prefill": 0.0, "decode": defaultdict(list)}
    plain_step = engine.step

    def timed_step():
        outputs = plain_step()
        s = engine.last_step
        if s is not None and s.num_seqs:
            if s.num_prefill_tokens:
                steps["prefill"] += s.duration
            else:
                steps["decode"][s.num_batched_tokens].append(s.duration)
        return outputs

    engine.step = timed_step
    answers = []
    for p in prompts:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], True)
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=p["max_tokens"]), use_tqdm=False)[0]
        answers.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
    return answers, steps


def accepted(draft: list[int], truth: list[int]) -> int:
    """How many of `draft` match `truth` from its start."""
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


def lookup(k: int):
    proposer = NgramProposer(SpeculativeConfig(**{**NGRAM, "num_speculative_tokens": k}))
    return lambda seq, p, limit: proposer.propose(seq[:p], min(k, limit))


def lookup_oracle(seq: list[int], p: int, limit: int) -> list[int]:
    """The longest correct copy from an earlier place j whose preceding token is the last one (j - 1 < p - 1)."""
    known = np.asarray(seq[:p])
    best = 0
    for j in np.flatnonzero(known[: p - 1] == known[p - 1]) + 1:
        best = max(best, accepted(seq[j : min(j + limit, p)], seq[p:]))
    return seq[p : p + best]


def perfect(k: int):
    return lambda seq, p, limit: seq[p : p + min(k, limit)]


def step_costs(steps: dict[int, list[float]], most: int) -> dict[int, float]:
    """Seconds a decode step costs by the rows it scores, 1 to `most`: one row's median as measured (the
    most common step), and from 2 rows on a straight line fitted to the measured medians, each weighted
    by its steps (the deep drafts' row counts come a few dozen times: their medians alone zigzag)."""
    rows = sorted(r for r in steps if r >= 2)
    a, b = np.polyfit(rows, [statistics.median(steps[r]) for r in rows], 1, w=[len(steps[r]) ** 0.5 for r in rows])
    return {1: statistics.median(steps[1]), **{r: a * r + b for r in range(2, most + 1)}}


def replay(answers, propose, step_seconds, max_drafts: int) -> tuple[float, int]:
    """Decode seconds and steps for every answer, each step scoring its last token and `propose`'s drafts."""
    seconds, steps = 0.0, 0
    for prompt, answer in answers:
        seq = prompt + answer
        p = len(prompt) + 1  # the answer's first token comes with the prefill
        while p < len(seq):
            draft = propose(seq, p, min(max_drafts, len(seq) - p - 1))
            seconds += step_seconds(1 + len(draft))
            steps += 1
            p += len(verify(draft, seq[p:]))  # as the engine walks a row's drafts
    return seconds, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results/speculative-bound.json"))
    ap.add_argument("--max-drafts", type=int, default=8, help="the n-gram run's and every replay's deepest draft")
    args = ap.parse_args()
    k = args.max_drafts
    ngram = {**NGRAM, "num_speculative_tokens": k}
    prompts = [json.loads(line) for line in (ROOT / "data/grounded.jsonl").read_text().splitlines()]

    start = time.perf_counter()
    answers, off = run(prompts, None)
    off_total = time.perf_counter() - start
    start = time.perf_counter()
    spec_answers, on = run(prompts, ngram)
    on_total = time.perf_counter() - start
    assert spec_answers == answers, "greedy answers differ with speculation"

    rows = sorted(on["decode"])
    median = {r: statistics.median(on["decode"][r]) for r in rows}
    cost = step_costs(on["decode"], k + 1)
    prefill = (off["prefill"] + on["prefill"]) / 2
    decode_off, steps_off = replay(answers, lambda *_: [], cost.__getitem__, k)
    lines = {"engine (measured)": {"ratio": off_total / on_total, "decode_s": sum(map(sum, on["decode"].values()))}}
    depths = sorted({d for d in (2, 4, 8) if d < k} | {k})
    proposers = {**{f"lookup-{d}": lookup(d) for d in depths}, "lookup-oracle": lookup_oracle,
                 **{f"perfect-{d}": perfect(d) for d in depths}}
    for name, propose in proposers.items():
        decode, steps = replay(answers, propose, cost.__getitem__, k)
        lines[name] = {"ratio": (prefill + decode_off) / (prefill + decode), "decode_s": decode,
                       "tokens_per_step": steps_off / steps}
    summary = {"command": " ".join(["python benchmarks/speculative_bound.py", *sys.argv[1:]]),
               "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
               "max_drafts": k, "prompts": len(answers), "output_tokens": sum(len(a) for _, a in answers),
               "prefill_s": prefill, "decode_off_s": decode_off, "decode_off_measured_s": sum(off["decode"][1]),
               "off_step_ms": 1e3 * statistics.median(off["decode"][1]),
               "step_ms_by_rows": {r: 1e3 * median[r] for r in rows}, "steps_by_rows": {r: len(on["decode"][r]) for r in rows},
               "fitted_step_ms": {r: 1e3 * c for r, c in cost.items()},
               "lines": lines}
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"prefill {prefill:.1f} s, decode without speculation {decode_off:.1f} s (measured "
          f"{summary['decode_off_measured_s']:.1f} s, {summary['off_step_ms']:.1f} ms a step); step ms by rows: "
          + ", ".join(f"{r}: {1e3 * median[r]:.1f}" for r in rows) + "; fitted: "
          + ", ".join(f"{r}: {1e3 * c:.1f}" for r, c in cost.items()))
    for name, line in lines.items():
        extra = f", {line['tokens_per_step']:.2f} tokens a step" if "tokens_per_step" in line else ""
        print(f"{name:18s} ratio {line['ratio']:.2f}x  decode {line['decode_s']:.1f} s{extra}")


if __name__ == "__main__":
    main()
