"""Chrome-trace JSON of lab runs (open in https://ui.perfetto.dev or chrome://tracing).

One process per run. Thread 0 holds the engine steps (X events with the batch size and tokens);
thread 1 + s holds an X span per request that used batch slot s (first scheduled to finish; slots are
exclusive, so spans never overlap); the wait before it (arrival to first scheduled) is an async
"queued" span, since waits do overlap. Timestamps are microseconds from the run's start.
"""

from __future__ import annotations

import json

from .driver import LabResult


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def trace_events(results: list[LabResult]) -> list[dict]:
    events: list[dict] = []
    for pid, res in enumerate(results):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": res.label}})
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "engine steps"}}
        )
        for slot in range(res.slots.num_slots):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": 1 + slot,
                    "args": {"name": f"slot {slot}"},
                }
            )
        for s in res.steps:
            events.append(
                {
                    "ph": "X",
                    "name": f"step {s.index}",
                    "cat": "step",
                    "pid": pid,
                    "tid": 0,
                    "ts": _us(s.start - res.start),
                    "dur": _us(s.duration),
                    "args": {
                        "num_seqs": s.num_seqs,
                        "num_batched_tokens": s.num_batched_tokens,
                        "prefill_tokens": s.num_prefill_tokens,
                        "draft_tokens": s.num_draft_tokens,
                        "accepted_tokens": s.num_accepted_tokens,
                        "forward_ms": round(s.forward_time * 1e3, 3),
                    },
                }
            )
        for r in res.requests.values():
            tid = 1 + res.slots.slot_of.get(r.request_id, 0)
            args = {
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "ttft_ms": round(r.ttft * 1e3, 2),
                "latency_ms": round(r.latency * 1e3, 2),
            }
            if r.first_scheduled > r.arrival:
                queued = {
                    "name": "queued",
                    "cat": "queue",
                    "pid": pid,
                    "tid": 0,
                    "id": f"{pid}-{r.request_id}",
                }
                events.append({**queued, "ph": "b", "ts": _us(r.arrival - res.start), "args": args})
                events.append({**queued, "ph": "e", "ts": _us(r.first_scheduled - res.start)})
            events.append(
                {
                    "ph": "X",
                    "name": r.request_id,
                    "cat": "request",
                    "pid": pid,
                    "tid": tid,
                    "ts": _us(r.first_scheduled - res.start),
                    "dur": _us(r.finished - r.first_scheduled),
                    "args": args,
                }
            )
    return events


def write_trace(results: list[LabResult], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": trace_events(results), "displayTimeUnit": "ms"}, f)
