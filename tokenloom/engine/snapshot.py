"""Engine snapshots for the live dashboard (server/dashboard.py): what the engine is doing, as one
plain JSON-able dict.

Two parts, with different costs:

- `EngineRecorder.on_step` is a step listener: it runs after every step, viewers or not, so the charts
  and the timeline have a history when somebody opens the page. It does O(1) work per step plus a
  look at each of the step's outputs (counters into one bucket per second, a TTFT sample when a first
  token came, a record when a request finished): well under a microsecond per output, against
  milliseconds per step.
- `EngineRecorder.build` walks the engine's state (queues, the KV block pool, the last step's rows).
  The dashboard calls it on the engine thread between two steps (AsyncLLM.call_on_engine), only while
  a viewer is connected and at most a few times a second; nothing calls it otherwise.

All times in a snapshot are seconds relative to its `now` (negative: in the past), so the page never
needs the server's clock. Prompt and output text are left out unless `show_text` (the operator's
`--dashboard-show-text`): request ids, counts and times only.
"""

from __future__ import annotations

import operator
from collections import deque

import numpy as np

from ..slo import Attainment
from ..step import SequenceStatus
from .kv_cache import held_blocks

# One character per KV block in the snapshot's `kv.map`: a 2,000-block pool is a 2,000-byte string
# built in numpy (tens of microseconds), which the page decodes with charCodeAt.
KV_FREE, KV_USED, KV_CACHED, KV_SHARED = 0, 1, 2, 3  # "0".."3"
HISTORY_S = 300  # the charts' window: the last five minutes, one bucket per second
MAX_TIMELINE = 48  # recent requests on the timeline
MAX_QUEUE_ROWS = 200  # rows per queue table (the counts are always whole)
MAX_TTFT_SAMPLES = 1000
TEXT_CHARS = 160  # with show_text: the head of the prompt, the tail of the output
_ITL_GAP_LIMIT_S = 5.0  # a gap this long between steps is an idle engine, not an inter-token latency
_REF_CNT = operator.attrgetter("ref_cnt")


def block_runs(block_ids: list[int]) -> list[list[int]]:
    """A block table as [first id, count] runs of consecutive ids: blocks are mostly taken from the free
    queue in order, so a request's table is a few runs, not one number per block (the KV map's
    per-request view, without a frame growing with every block in use)."""
    runs: list[list[int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return runs


class EngineRecorder:
    """Feeds on the engine's steps (`engine.step_listeners`) and builds snapshots on request."""

    def __init__(self, engine, model_name: str = "", show_text: bool = False):
        self.engine = engine
        self.model_name = model_name
        self.show_text = show_text
        plan = getattr(getattr(engine, "model", None), "plan", None)
        self.plan_line = plan.line() if plan is not None and hasattr(plan, "line") else ""
        # [second, generated tokens, prompt tokens computed, ITL sum (s x rows), ITL rows, steps]
        self._buckets: deque[list] = deque(maxlen=HISTORY_S)
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_TTFT_SAMPLES)  # (time, seconds)
        self._ended: deque[dict] = deque(maxlen=MAX_TIMELINE)  # finished requests' timeline records
        self._live: dict[str, dict] = {}  # timeline records of requests seen alive by the last build
        self._preempted_at: dict[str, list[float]] = {}  # seq id -> times it was preempted (while watched)
        self._prev_end: float | None = None
        self.attainment = Attainment()  # SLO attainment of the requests finished since start (slo.py)
        self.watched = False  # set by the dashboard while a viewer is connected
        self.num_builds = 0
        engine.step_listeners.append(self.on_step)

    # -- every step (the engine thread) -----------------------------------------------------------

    def on_step(self, stats, outputs) -> None:
        end = stats.start + stats.duration
        sec = int(end)
        buckets = self._buckets
        if not buckets or buckets[-1][0] != sec:
            buckets.append([sec, 0, 0, 0.0, 0, 0])
        b = buckets[-1]
        b[1] += stats.shape.num_sampled + stats.num_accepted_tokens
        b[2] += stats.num_prefill_tokens
        b[5] += 1
        # ITL as vLLM defines it (the gap since the same sequence's previous token): a row that decodes
        # now got its previous token at the end of the previous step.
        if stats.num_decode_tokens and self._prev_end is not None and end - self._prev_end < _ITL_GAP_LIMIT_S:
            b[3] += (end - self._prev_end) * stats.num_decode_tokens
            b[4] += stats.num_decode_tokens
        self._prev_end = end
        for out in outputs:
            m = out.metrics
            if m is not None and m.first_token_time is not None and m.first_token_time >= stats.start:
                self._ttft.append((m.first_token_time, m.first_token_time - m.arrival_time))
            if out.finished:
                self._ended.append(self._record(out.request_id, m, out, end))
                self.attainment.add_output(out, end)
        if not self.watched:
            if self._preempted_at:  # the last viewer left: what is kept only while watched goes
                self._preempted_at.clear()
        elif stats.num_preempted:
            # Preempted sequences are back in the waiting queue; their count says which are new.
            for seq in self.engine.scheduler.waiting:
                times = self._preempted_at.setdefault(seq.seq_id, [])
                times.extend([stats.start] * (seq.num_preemptions - len(times)))

    def _record(self, request_id: str, m, out, end: float) -> dict:
        reason = "error" if out.error is not None else (out.outputs[0].finish_reason if out.outputs else None)
        rec = self._live.pop(request_id, None) or {"id": request_id}
        rec.update(arrival=m.arrival_time, scheduled=m.first_scheduled_time, first_token=m.first_token_time,
                   end=m.finished_time or end, reason=reason or "stop",
                   output_tokens=sum(len(o.token_ids) for o in out.outputs))
        rec.setdefault("preempted", [])
        rec["preempted"] += [end] * (m.num_preemptions - len(rec["preempted"]))
        return rec

    # -- on request (the engine thread, between steps) --------------------------------------------

    def build(self, engine=None) -> dict:
        engine = engine or self.engine
        self.num_builds += 1
        now = engine.clock()
        sched, kv, config = engine.scheduler, engine.kv, engine.config
        live = engine.requests

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - now, 3)

        def seq_name(seq) -> str:
            return seq.request_id if seq.params.n == 1 else seq.seq_id

        # The last step's rows, for the requests still alive (an aborted one leaves the view at once).
        rows, step = [], engine.last_step
        if step is not None:
            drafts = step.row_drafts or [0] * len(step.seq_ids)
            for seq_id, (n, context), d in zip(step.seq_ids, step.shape.rows, drafts, strict=False):
                rid = seq_id.rpartition("#")[0]
                state = live.get(rid)
                if state is None:
                    continue
                rows.append({"id": rid if len(state.seqs) == 1 else seq_id, "tokens": n,
                             "kind": "decode" if n - d == 1 else "prefill", "drafts": d, "context": context})

        running = [self._seq_row(s, now, seq_name) for s in sched.running[:MAX_QUEUE_ROWS]]
        waiting = [s for s in sched.waiting if s.status == SequenceStatus.WAITING]
        swapped = [s for s in sched.waiting if s.status == SequenceStatus.SWAPPED]
        waiting.sort(key=lambda s: s.times.arrival)
        swapped.sort(key=lambda s: s.times.arrival)

        snap = {
            "now": now,
            "model": self.model_name,
            "plan": self.plan_line,
            "config": {"max_num_batched_tokens": config.max_num_batched_tokens, "max_num_seqs": config.max_num_seqs,
                       "block_size": config.block_size, "batching": config.batching,
                       "preemption_mode": config.preemption_mode, "show_text": self.show_text},
            "step": {
                "number": engine.num_steps,
                "age_s": rel(step.start + step.duration) if step is not None else None,
                "duration_ms": round(step.duration * 1000, 3) if step is not None else None,
                "rows": rows,
                "used": sum(r["tokens"] for r in rows),
                "budget": config.max_num_batched_tokens,
                "preempted": step.num_preempted if step is not None else 0,
            },
            "running": running,
            "num_running": len(sched.running),
            "waiting": [self._seq_row(s, now, seq_name) for s in waiting[:MAX_QUEUE_ROWS]],
            "num_waiting": len(waiting),
            "swapped": [self._seq_row(s, now, seq_name) for s in swapped[:MAX_QUEUE_ROWS]],
            "num_swapped": len(swapped),
            "num_preemptions": sched.num_preemptions,
            "kv": self._kv(kv),
            "timeline": self._timeline(live, now, rel),
            "series": self._series(now),
            "slo": self.attainment.to_dict(now),
        }
        return snap

    def _seq_row(self, seq, now: float, seq_name) -> dict:
        blocks = held_blocks(seq)  # every KV group's, in table order
        row = {"id": seq_name(seq), "age_s": round(now - seq.times.arrival, 3), "priority": seq.params.priority,
               "prompt_tokens": seq.num_prompt_tokens, "output_tokens": seq.num_output_tokens,
               "computed": seq.num_computed_tokens, "blocks": len(blocks), "host_blocks": len(seq.host_blocks),
               "block_runs": block_runs(blocks), "preemptions": seq.num_preemptions}
        if self.show_text:
            state = self.engine.requests.get(seq.request_id)
            prompt = state.prompt if state is not None and state.prompt is not None else ""
            row["prompt"] = prompt[:TEXT_CHARS]
            row["output"] = seq.output_text[-TEXT_CHARS:]
        return row

    @staticmethod
    def _kv(kv) -> dict:
        refs = np.fromiter(map(_REF_CNT, kv.blocks), dtype=np.int64, count=kv.num_blocks)
        codes = np.minimum(refs, 2).astype(np.uint8)  # 0 free, 1 one owner, 2 several
        codes[codes == 2] = KV_SHARED
        cached = [b.block_id for b in kv.cached.values() if b.ref_cnt == 0]
        if cached:
            codes[cached] = KV_CACHED
        counts = np.bincount(codes, minlength=4)
        host_used = kv.num_host_blocks - len(kv.free_host_blocks)
        return {
            "num_blocks": kv.num_blocks,
            "map": (codes + ord("0")).tobytes().decode("ascii"),
            "free": int(counts[KV_FREE]), "used": int(counts[KV_USED]), "cached": int(counts[KV_CACHED]),
            "shared": int(counts[KV_SHARED]),
            "host_blocks": kv.num_host_blocks, "host_used": host_used,
            "usage": round(kv.usage, 4),
            "prefix_queries": kv.prefix_queries, "prefix_hits": kv.prefix_hits,
            "hit_rate": round(kv.prefix_hits / kv.prefix_queries, 4) if kv.prefix_queries else None,
        }

    def _timeline(self, live: dict, now: float, rel) -> list[dict]:
        seen: dict[str, dict] = {}
        for rid, state in live.items():
            seqs = state.seqs
            rec = self._live.get(rid) or {"id": rid, "preempted": []}
            times = [s.times for s in seqs]
            rec.update(arrival=seqs[0].times.arrival,
                       scheduled=min((t.first_scheduled for t in times if t.first_scheduled), default=None),
                       first_token=min((t.first_token for t in times if t.first_token), default=None),
                       end=None, reason=None, output_tokens=sum(s.num_output_tokens for s in seqs))
            recorded = [t for s in seqs for t in self._preempted_at.get(s.seq_id, ())]
            count = sum(s.num_preemptions for s in seqs)
            rec["preempted"] = sorted(recorded)[:count] + [now] * (count - len(recorded))
            seen[rid] = rec
        ended_ids = {rec["id"] for rec in self._ended}
        for rid, rec in self._live.items():
            if rid not in seen and rid not in ended_ids:  # gone without a final output: aborted
                rec.update(end=now, reason="abort")
                self._ended.append(rec)
        self._live = seen
        alive = {s.seq_id for state in live.values() for s in state.seqs}
        for seq_id in [k for k in self._preempted_at if k not in alive]:
            del self._preempted_at[seq_id]
        recent = sorted([*self._ended, *seen.values()], key=lambda r: r["arrival"])[-MAX_TIMELINE:]
        return [{"id": r["id"], "arrival": rel(r["arrival"]), "scheduled": rel(r["scheduled"]),
                 "first_token": rel(r["first_token"]), "end": rel(r["end"]), "reason": r["reason"],
                 "output_tokens": r["output_tokens"], "preempted": [rel(t) for t in r["preempted"]]}
                for r in recent]

    def _series(self, now: float) -> dict:
        """Per second of the last HISTORY_S (t = the second's start): tokens generated and prompt tokens computed, mean ITL (ms);
        TTFT samples (ms)."""
        cutoff = now - HISTORY_S
        buckets = [[round(b[0] - now, 3), b[1], b[2], round(b[3] / b[4] * 1000, 2) if b[4] else None, b[5]]
                   for b in list(self._buckets) if b[0] >= cutoff]
        ttft = [[round(t - now, 3), round(v * 1000, 1)] for t, v in list(self._ttft) if t >= cutoff]
        return {"window_s": HISTORY_S, "columns": ["t", "generated", "prompt", "itl_ms", "steps"],
                "buckets": buckets, "ttft_ms": ttft}



_PUBLIC_MAP = bytes.maketrans(b"0123", b"0101")  # cached blocks are free to take, shared ones in use
_TEXT = ("prompt", "output")


def redacted(snap: dict, *, prefix_cache: bool, text: bool) -> dict:
    """A snapshot as a viewer of lesser rights sees it (server/tenancy.py). Without `prefix_cache` (an
    API key holder): everything that shows a prefix hit is gone (the hit counters, the cached / shared
    marks of the block map, each request's block ids: two requests on one block share a prefix).
    Without `text`: the rows' prompt and output. A new dict; `snap` (the operator's) is not changed."""
    out = dict(snap)
    private = (() if text else _TEXT) + (() if prefix_cache else ("block_runs",))
    if not private:
        return out
    if not prefix_cache and isinstance(kv := snap.get("kv"), dict):
        kv = {k: v for k, v in kv.items() if k not in ("prefix_queries", "prefix_hits", "cached", "shared")}
        kv["hit_rate"] = None
        if "map" in kv:
            kv["map"] = kv["map"].encode("ascii").translate(_PUBLIC_MAP).decode("ascii")
            kv["free"] = kv["map"].count("0")
            kv["used"] = kv["num_blocks"] - kv["free"]
        out["kv"] = kv
    for queue in ("running", "waiting", "swapped"):
        if queue in snap:
            out[queue] = [{k: v for k, v in row.items() if k not in private} for row in snap[queue]]
    if "config" in snap and not text:
        out["config"] = {**snap["config"], "show_text": False}
    return out
