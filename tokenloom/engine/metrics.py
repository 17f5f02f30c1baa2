"""Engine metrics: a Prometheus registry with vLLM's metric names under `tokenloom:`, plus logs.

`EngineMetrics` is fed on the engine thread (by AsyncLLM after every step and after aborts) and is
read by `/metrics` through `render()`. It owns its own `CollectorRegistry`, so several engines (or
tests) in one process never collide on the global registry. Besides the metrics it writes one log
line per finished request (id, prompt/output tokens, TTFT, total time) and, while the engine is
busy, a status line every `log_interval_s` (running, waiting, KV usage, throughput, prefix hits).

Definitions follow vLLM: TTFT = first token time - arrival; inter-token latency is one sample per
generated token (gap since the same sequence's previous token); e2e = finish - arrival; queue time
= first scheduled - arrival; prefix-cache queries and hits are counted in tokens; the KV usage
gauge is a 0-1 fraction.

SLO attainment (slo.py; issue 56): a request finished by stop or length that had an SLO counts once in
`slo_requests_total` and in `slo_attained_total{slo="ttft"|"tpot"|"both"}` for each it met, by the load
generator's definitions (TTFT to the first token, TPOT = (last token - first token) / (tokens - 1), from the
server's arrival time); a request refused by --slo-shed counts as met nothing (and in `slo_shed_total`).
`slo_goodput` is the requests per second that met both over the last minute.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..outputs import RequestOutput
from ..slo import ATTAINMENT_KINDS, Attainment

if TYPE_CHECKING:
    from .stats import EngineStats

logger = logging.getLogger("tokenloom.metrics")

__all__ = ["CONTENT_TYPE", "EngineMetrics"]

# Bucket edges as vLLM uses them, so dashboards built for vLLM read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class EngineMetrics:
    def __init__(self, model_name: str = "tokenloom", log_interval_s: float = 10.0, log_requests: bool = True):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.log_interval_s = log_interval_s
        self.log_requests = log_requests
        # The newest stats the engine thread published: one reference, read off that thread without a
        # lock (a multi-model server's dashboard shows every model's batch from it).
        self.latest: EngineStats | None = None

        def metric(kind, name: str, doc: str, buckets: tuple | None = None):
            extra = {"buckets": buckets} if buckets else {}
            family = kind(f"tokenloom:{name}", doc, ["model_name"], registry=self.registry, **extra)
            return family.labels(model_name)

        gauge, counter, histogram = partial(metric, Gauge), partial(metric, Counter), partial(metric, Histogram)
        self.running = gauge("num_requests_running", "Sequences running (in the batch).")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.swapped = gauge("num_requests_swapped", "Sequences whose KV cache is swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage as a 0-1 fraction of blocks in use.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hit rate in tokens since start (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens (counted once per request).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Sequence preemptions.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self._success = Counter("tokenloom:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.req_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.req_gen_tokens = histogram("request_generation_tokens", "Generated tokens per request (all choices).",
                                        TOKEN_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.batch_size = histogram("iteration_num_seqs", "Sequences per engine step (batch size).", BATCH_SIZE_BUCKETS)
        # Speculative decoding (vLLM's names); present only when the engine speculates.
        self.spec_drafts = counter("spec_decode_num_drafts", "Rows that carried speculative drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens scored.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self._spec_per_pos = Counter("tokenloom:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by position in the draft (0 = the first).",
                                     ["model_name", "position"], registry=self.registry)

        self.slo_requests = counter("slo_requests", "Finished requests that had an SLO (refused by --slo-shed too).")
        self.slo_shed = counter("slo_shed", "Requests refused (429) because they were predicted to miss their SLO.")
        self.slo_goodput = gauge("slo_goodput", "Requests per second that met every SLO target, over the last minute.")
        slo_attained = Counter("tokenloom:slo_attained", "Finished requests that met their SLO target, by target.",
                               ["model_name", "slo"], registry=self.registry)
        self._slo_attained = {kind: slo_attained.labels(model_name, kind) for kind in ATTAINMENT_KINDS}
        self.attainment = Attainment()

        # Per request: choice index -> (tokens seen, time of its last token).
        self._tracked: dict[str, dict[int, tuple[int, float]]] = {}
        self._counted: dict[Counter, int] = {}  # counter -> engine total it has counted up to
        # Tokens since the last status line, for its throughput (prometheus children are write-mostly).
        self._log_prompt = self._log_gen = 0
        self._last_log = time.monotonic()

    # -- feeding (engine thread) -----------------------------------------------------------------

    def on_step(self, engine, stats, outputs: list[RequestOutput]) -> None:
        if stats is not None and stats.num_seqs:
            self.iteration_tokens.observe(stats.num_batched_tokens)
            self.batch_size.observe(stats.num_seqs)
            # The status line's prompt throughput: prompt tokens computed as the steps compute them, so a
            # long prefill shows (the counter below counts a prompt once, at its first token, as vLLM's).
            self._log_prompt += stats.num_prefill_tokens
        now = stats.start + stats.duration if stats is not None else time.monotonic()
        for out in outputs:
            self._on_output(out, now)
        self.slo_goodput.set(self.attainment.goodput(now))
        self._update_gauges(engine)
        self._maybe_log_status(engine)

    def on_idle(self, engine) -> None:
        """After aborts with no step to follow: refresh the gauges so /metrics shows freed blocks."""
        self._update_gauges(engine)

    def on_abort(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self._success.labels(self.model_name, "abort").inc()
        if self.log_requests:
            logger.info("request %s aborted", request_id)

    def _on_output(self, out: RequestOutput, now: float) -> None:
        seen = self._tracked.setdefault(out.request_id, {})
        first_tokens = not seen
        new_total = 0
        for choice in out.outputs:
            n = len(choice.token_ids)
            prev_n, prev_time = seen.get(choice.index, (0, None))
            new = n - prev_n
            if new <= 0:
                continue
            new_total += new
            if prev_time is not None:
                gap = (now - prev_time) / new
                for _ in range(new):
                    self.itl.observe(gap)
            seen[choice.index] = (n, now)
        self.generation_tokens.inc(new_total)
        self._log_gen += new_total
        m = out.metrics
        if first_tokens and new_total:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if m is not None and m.first_token_time is not None:
                self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
        if out.finished:
            self._on_finished(out, now)

    def on_shed(self, now: float | None = None) -> None:
        """A request refused under --slo-shed: it met none of its targets."""
        self.attainment.add_shed(time.monotonic() if now is None else now)
        self.slo_shed.inc()
        self.slo_requests.inc()

    def _on_finished(self, out: RequestOutput, now: float) -> None:
        self._tracked.pop(out.request_id, None)
        met = self.attainment.add_output(out, now)
        if met is not None:
            self.slo_requests.inc()
            for kind, ok in met.items():
                self._slo_attained[kind].inc(ok)
        m = out.metrics
        gen = sum(len(c.token_ids) for c in out.outputs)
        reason = out.outputs[0].finish_reason or "unknown"
        self._success.labels(self.model_name, reason).inc()
        self.req_prompt_tokens.observe(len(out.prompt_token_ids))
        self.req_gen_tokens.observe(gen)
        ttft = total = None
        if m is not None:
            total = max((m.finished_time or now) - m.arrival_time, 0.0)
            self.e2e.observe(total)
            if m.first_scheduled_time is not None:
                self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            if m.first_token_time is not None:
                ttft = m.first_token_time - m.arrival_time
        if self.log_requests:
            logger.info(
                "request %s finished (%s): prompt %d tokens, output %d tokens, TTFT %s, total %s",
                out.request_id, reason, len(out.prompt_token_ids), gen, _ms(ttft), _ms(total),
            )

    def _update_gauges(self, engine) -> None:
        st = self.latest = engine.stats()
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.swapped.set(st.num_swapped)
        self.kv_usage.set(st.kv_usage)
        self.prefix_hit_rate.set(st.prefix_hit_rate)
        # The engine keeps running totals; add to each counter what it has not counted yet.
        for counter, total in ((self.prefix_queries, st.prefix_queries), (self.prefix_hits, st.prefix_hits),
                               (self.preemptions, st.num_preemptions)):
            counter.inc(max(total - self._counted.get(counter, 0), 0))
            self._counted[counter] = total
        slo = getattr(getattr(engine, "scheduler", None), "slo", None)
        for _ in range(slo.num_shed - self._counted.get(self.slo_shed, 0) if slo is not None else 0):
            self.on_shed()
        if slo is not None:
            self._counted[self.slo_shed] = slo.num_shed
        spec = getattr(engine, "speculation", None)
        if spec is not None:
            st = spec.stats
            totals = [(self.spec_drafts, st.num_drafts), (self.spec_draft_tokens, st.num_draft_tokens),
                      (self.spec_accepted_tokens, st.num_accepted_tokens)]
            totals += [(self._spec_per_pos.labels(self.model_name, str(i)), n) for i, n in enumerate(st.accepted_per_pos)]
            for counter, total in totals:
                counter.inc(max(total - self._counted.get(counter, 0), 0))
                self._counted[counter] = total

    def _maybe_log_status(self, engine) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.log_interval_s:
            return
        prompt, gen = self._log_prompt, self._log_gen
        self._last_log, self._log_prompt, self._log_gen = now, 0, 0
        st = engine.stats()
        spec = getattr(engine, "speculation", None)
        logger.info(
            "engine: running %d, waiting %d, swapped %d, KV usage %.1f%%, prompt %.1f tok/s, "
            "generation %.1f tok/s, prefix hit rate %.1f%%%s",
            st.num_running, st.num_waiting, st.num_swapped, 100 * st.kv_usage, prompt / elapsed, gen / elapsed,
            100 * st.prefix_hit_rate,
            f", draft acceptance {100 * spec.stats.acceptance_rate:.1f}%" if spec is not None else "",
        )

    # -- reading (event loop) --------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"
