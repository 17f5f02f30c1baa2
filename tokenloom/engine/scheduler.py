"""The scheduler: at every step, which sequences run and how many tokens each computes.

There are no prefill and decode phases. Each step hands out a token budget
(`max_num_batched_tokens`) so that every sequence's computed tokens catch up with its tokens:
a decode needs 1, a prompt needs the rest of its prompt (a chunk of it, with chunked prefill), a
sequence resumed after recompute-preemption needs everything again. Prefill chunks and decodes
therefore share a step.

1. Running sequences first, in policy order. If the KV cache cannot hold a sequence's new tokens,
   the worst running sequence (by policy; the sequence itself if it is the worst) is preempted:
   by recompute (blocks freed, back to waiting) or by swap (blocks copied to the host pool).
2. Then, if nobody was preempted this step, waiting sequences in policy order while the budget,
   `max_num_seqs` and the KV cache allow; prefix-cache hits are taken on first admission.

With stall-free batching (`stall_free_factor` > 0, engine/stall_free.py), while sequences decode, a
prompt longer than one step's budget is sliced by an allowance steered by measured step times, so the
step takes about that factor times the same step without prefill: decodes never wait behind a long
prompt's whole chunks.

Speculative drafts (set on decoding sequences by the engine before it schedules) are extra tokens of
their sequence's row, inside the same budget, fitted last from what the step leaves over
(`_fit_drafts`): they never preempt, delay or shut out anybody, and are dropped where there is no room.

Under `--scheduling-policy slo` (engine/slo_policy.py) the policy key is the slack to each request's SLO,
requests that can no longer make theirs give up their seats to those that can (`_yield_seats`), and the
stall-free allowance is capped by the tightest TPOT among the decoding rows, slicing every prompt.

With `--fairness vtc` (engine/fairness.py) waiting sequences are admitted lowest virtual token counter
of their tenant first, the policy ordering those of equal counters; every planned token is charged; and
while the batch is full, a tenant with nothing running gets a seat from the tenant of the highest
counter (`_fair_seat`).

The batching mode only decides who may be admitted: `continuous` admits at every step; `static`
forms a batch of up to `max_num_seqs` only when nothing runs, and admits no one else until the
whole batch has finished, computing the slots of finished members as padding the way a padded static
batch does; `dynamic` does the same but forms the batch only once it is full or the
oldest waiting request has waited `max_wait_ms`.
"""

from __future__ import annotations

import time

from ..config import EngineConfig
from ..step import Sequence, SequenceStatus, StepPlan
from .fairness import VirtualTokenCounter, tenant_of
from .kv_cache import KVCacheManager
from .policies import get_policy
from .slo_policy import SLOScheduling
from .stall_free import StallFreeBudget


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, stall_free: StallFreeBudget | None = None):
        self.config = config
        self.kv = kv
        self.stall_free = stall_free
        # This step, for the stall-free cap: does anybody decode, and the prompt tokens planned so far.
        self._decoding = False
        self._planned_prefill = 0
        self._adapters: set[str] = set()  # LoRA adapters in this step (at most max_loras)
        self.slo = SLOScheduling() if config.scheduling_policy == "slo" else None
        self.policy = self.slo.key if self.slo is not None else get_policy(config.scheduling_policy,
                                                                           config.priority_aging_s)
        self.vtc = VirtualTokenCounter() if config.fairness == "vtc" else None
        self.waiting: list[Sequence] = []  # WAITING and SWAPPED sequences
        self.running: list[Sequence] = []
        self.batch: set[str] | None = None  # members of the current static/dynamic batch
        self.num_preemptions = 0
        self.num_swaps = 0

    # -- queue management ------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if self.vtc is not None:
            self.vtc.arrive(seq, self.waiting + self.running)
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release its KV (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    @property
    def num_swapped(self) -> int:
        return sum(1 for s in self.waiting if s.status == SequenceStatus.SWAPPED)

    # -- the step plan ---------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepPlan:
        now = time.monotonic() if now is None else now
        out = StepPlan()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: self.policy(s, now))
        self._planned_prefill = 0
        self._adapters = set()
        yielded = self._yield_seats(out, now) if self.slo is not None else 0
        yielded += self._fair_seat(out) if self.vtc is not None else 0
        if self.slo is not None and self.stall_free is not None:
            self.stall_free.tpot_cap = self.slo.tpot_cap(self.running, now)
        self._decoding = any(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget) if self._adapter_fits(seq) else 0
            if n == 0:  # no room under the stall-free cap, or its LoRA adapter past max_loras: next step
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()  # the worst by policy; `seq` itself when it is the last
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self._plan(out, seq, n)
                budget -= n
                i += 1

        if len(out.preempted) == yielded:  # nobody preempted for KV room (seats given up are for admissions)
            budget = self._admit(out, budget, now)
        self._fit_drafts(out, budget)
        if self.stall_free is not None:
            decode_rows = [(1, s.num_computed_tokens + 1) for s, n in out.scheduled
                           if s.num_tokens - s.num_computed_tokens == 1]
            self.stall_free.planned(decode_rows, self._planned_prefill)
        if self.batch is not None:
            out.num_padding = max(len(self.batch) - len(out.scheduled), 0)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        return out

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        """Tokens a sequence computes this step: its remaining ones within the budget, the long-prefill
        threshold and, when stall-free, the measured allowance for a prompt longer than one step's
        budget (a shorter one goes whole: slicing it would cost throughput, each slice re-reading the
        weights, to smooth a single step)."""
        limit = self.config.long_prefill_token_threshold
        n = min(remaining, budget, limit) if limit > 0 else min(remaining, budget)
        if self.stall_free is not None and remaining > 1 and (
                seq.num_tokens > self.config.max_num_batched_tokens or self.stall_free.tpot_cap is not None):
            n = self.stall_free.chunk_limit(self._decoding, self._planned_prefill, n)
        return n

    def _yield_seats(self, out: StepPlan, now: float) -> int:
        """The slo policy: while the batch is full and requests that can still meet their SLO wait, the
        running rows that can no longer meet theirs (last in policy order) are preempted to free seats.
        Returns how many."""
        if self.config.batching != "continuous":
            return 0
        hopeful = sum(1 for s in self.waiting if s.params.slo is not None and not self.slo.late(s, now))
        n = 0
        while (hopeful > n and len(self.running) >= self.config.max_num_seqs
               and self.slo.late(self.running[-1], now)):
            self._preempt(self.running.pop(), out)
            n += 1
        return n

    def _fair_seat(self, out: StepPlan) -> int:
        """--fairness vtc: while the batch is full and the waiting sequence of the lowest counter is of a
        tenant with nothing running, the running row of the highest counter (of those, the one with the
        fewest computed tokens: the least to recompute) gives up its seat, if its counter is above the
        waiting one's. So a light tenant waits for one step, not for a heavy tenant's requests to end.
        Returns how many seats were given up (0 or 1)."""
        if (self.config.batching != "continuous" or not self.waiting
                or len(self.running) < self.config.max_num_seqs):
            return 0
        counter = self.vtc.counter
        best = min(self.waiting, key=counter)
        if tenant_of(best) in {tenant_of(s) for s in self.running}:
            return 0
        victim = max(self.running, key=lambda s: (counter(s), -s.num_computed_tokens))
        if counter(victim) <= counter(best):
            return 0
        self.running.remove(victim)
        self._preempt(victim, out)
        return 1

    def _fit_drafts(self, out: StepPlan, budget: int) -> None:
        """Speculative drafts ride on what the step leaves over: after every running row and admission
        has its tokens and blocks, each decoding row in plan order takes its drafts while the budget and
        free blocks last (so drafts never preempt, delay or shut out anybody); the rest are dropped."""
        for k, (seq, n) in enumerate(out.scheduled):
            if not seq.spec_token_ids:
                continue
            # Drafts follow only a row that reaches the last known token.
            room = max(budget, 0) if seq.num_computed_tokens + n == seq.num_tokens else 0
            del seq.spec_token_ids[room:]
            while seq.spec_token_ids and not self.kv.allocate_slots(seq, n + len(seq.spec_token_ids)):
                seq.spec_token_ids.pop()
            out.scheduled[k] = (seq, n + len(seq.spec_token_ids))
            budget -= len(seq.spec_token_ids)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """May the sequence run in this step: no adapter, or one already in it, or room for one more."""
        return (seq.lora is None or seq.lora.name in self._adapters
                or len(self._adapters) < self.config.max_loras)

    def _plan(self, out: StepPlan, seq: Sequence, n: int) -> None:
        out.scheduled.append((seq, n))
        if seq.lora is not None:
            self._adapters.add(seq.lora.name)
        prefill = seq.num_tokens - seq.num_computed_tokens > 1
        if prefill:
            self._planned_prefill += n
        if self.vtc is not None:
            self.vtc.charge(seq, n if prefill else 0, 0 if prefill else n)

    def _admit(self, out: StepPlan, budget: int, now: float) -> int:
        """Admit waiting sequences in policy order; returns the budget left."""
        if not self._batch_open(now):
            return budget
        order = None
        if self.vtc is not None:  # lowest counter first; an admission raises its tenant's, so re-sort after it
            keys = {id(s): self.policy(s, now) for s in self.waiting}

            def order(s: Sequence) -> tuple:
                return self.vtc.counter(s), keys[id(s)]

            self.waiting.sort(key=order)
        else:
            self.waiting.sort(key=lambda s: self.policy(s, now))
        idx = 0
        while idx < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[idx]
            if (self.batch is not None and seq.seq_id not in self.batch) or not self._adapter_fits(seq):
                idx += 1
                continue
            n = self._admit_one(seq, budget, out, now)
            if n == 0:
                break  # no room in the KV cache (or the budget): keep the policy order, stop here
            self.waiting.pop(idx)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            self._plan(out, seq, n)
            budget -= n
            if order is not None:
                self.waiting[idx:] = sorted(self.waiting[idx:], key=order)  # nearly sorted: linear
        return budget

    def _admit_one(self, seq: Sequence, budget: int, out: StepPlan, now: float) -> int:
        """Allocate for a waiting sequence; returns the tokens it computes this step (0 = not admitted)."""
        if seq.status == SequenceStatus.SWAPPED:
            n = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:
                return 0
            if self.kv.blocks_to_swap_in(seq, n) > self.kv.num_free_blocks:
                return 0
            out.swap_in.extend(self.kv.swap_in(seq))
            allocated = self.kv.allocate_slots(seq, n)
            assert allocated, "swap-in checked the free blocks"
            return n
        hits = self.kv.get_computed_blocks(seq) if seq.num_computed_tokens == 0 else []
        hit_tokens = len(hits) * self.kv.block_size
        remaining = seq.num_tokens - seq.num_computed_tokens - hit_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        n = self._chunk(seq, remaining, budget)
        if n == 0 or not self.kv.allocate_slots(seq, n, hits):
            return 0
        seq.num_computed_tokens += hit_tokens
        if seq.times.first_scheduled is None:  # first admission; lookups of retries that did not fit don't count
            seq.times.first_scheduled = now
            seq.num_cached_prompt_tokens = hit_tokens
            self.kv.prefix_queries += seq.num_tokens
            self.kv.prefix_hits += hit_tokens
        return n

    def _preempt(self, victim: Sequence, out: StepPlan) -> None:
        victim.spec_token_ids = []
        self.num_preemptions += 1
        victim.num_preemptions += 1
        out.preempted.append(victim)
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(victim):
            out.swap_out.extend(self.kv.swap_out(victim))
            victim.status = SequenceStatus.SWAPPED
            self.num_swaps += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.WAITING
        self.waiting.append(victim)

    # -- batching modes --------------------------------------------------------------------------

    def batch_due_time(self) -> float | None:
        """When a dynamic batch still waiting for company closes by its timer: the oldest waiting arrival
        + max_wait_ms (None if no such wait). `_batch_open` compares the clock with this very number, so a
        replay on a clock that can jump goes straight there and finds the batch open (computed as
        (now - oldest) * 1000 < max_wait_ms, a rounding could keep it shut at that very time)."""
        if (self.config.batching != "dynamic" or self.batch is not None or self.running or not self.waiting
                or len(self.waiting) >= self.config.max_num_seqs):
            return None
        return min(s.times.arrival for s in self.waiting) + self.config.max_wait_ms / 1000

    def _batch_open(self, now: float) -> bool:
        """May waiting sequences be admitted now? Forms the next static/dynamic batch when due."""
        mode = self.config.batching
        if mode == "continuous":
            return True
        if self.batch is not None and any(s.seq_id in self.batch for s in self.running + self.waiting):
            return True  # the current batch still has members to (re)admit or to finish
        self.batch = None
        if self.running or not self.waiting:
            return False
        due = self.batch_due_time()  # None unless a dynamic batch is short of max_num_seqs
        if due is not None and now < due:
            return False
        size = self.config.max_num_seqs
        self.waiting.sort(key=lambda s: self.policy(s, now))
        self.batch = {s.seq_id for s in self.waiting[:size]}
        return True
