"""`--scheduling-policy slo`: each step, who runs and how much prompt it carries, to keep the most requests
inside their SLOs (slo.py; issue 56). The rules, all in the scheduler's terms:

- **Least slack first.** A request before its first token has slack = its TTFT deadline (arrival +
  ttft_ms) - now - its predicted prefill time (the prompt left x the measured seconds per prompt token,
  plus a step); a decoding one, the deadline of its next token for its TPOT to hold (first token + tpot_ms
  x tokens so far) - now - a decode step. The policy key sorts by slack, so the waiting queue admits the
  least slack first and the running rows most at risk of missing their TPOT are planned first and
  preempted last (preemption takes the worst key): they stay in the batch.
- **Who can no longer make it yields.** A request predicted to miss (its TTFT deadline passed or
  unreachable, a TTFT already missed, or a TPOT that even one token per decode step from now cannot bring
  back under its target, or its end-to-end deadline) sorts after every request that still can: it is
  admitted last, preempted first, and, while the batch is full (max_num_seqs) and a request that can still
  make it waits, preempted to give up its seat (`Scheduler._yield_seats`). It is never dropped: it runs
  when there is room and finishes, late.
- **Prefill sized from the decoding rows' slack.** While rows decode, the stall-free allowance
  (stall_free.py) steers each step to at most the time until the most pressed decoding row's next token
  is due for its TPOT to hold (never less than its `tpot_ms`; and its factor x the decode-only step), and
  every prompt is sliced by it, not only those longer than a step's budget.
- **Shedding** (`--slo-shed`): a new request whose predicted TTFT (the prompt tokens ahead of it by the
  policy order, and its own, at the measured seconds per token) exceeds SHED_MARGIN x its target is
  refused at once (`SLOShedError`, a 429 with Retry-After: the predicted time to clear the work ahead).

Requests without an SLO have infinite slack: they run after those with one, in arrival order.
Step times are measured online (exponential averages of this engine's own steps); before any are known
the predictions are 0 and the order is plain earliest-deadline-first.
"""

from __future__ import annotations

import math

from ..step import Sequence

SHED_MARGIN = 2.0  # shed a request predicted to take more than this times its TTFT target
_EMA = 0.2
_NO_DEADLINE = 1e18


def _tpot_s(seq: Sequence) -> float | None:
    slo = seq.params.slo
    return slo.tpot_ms / 1000 if slo is not None and slo.tpot_ms is not None else None


class SLOShedError(RuntimeError):
    """A request refused because it was predicted to miss its SLO by a wide margin (a 429)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SLOScheduling:
    def __init__(self):
        self.step_s = 0.0  # a decode-only step (seconds), measured
        self.token_s = 0.0  # seconds per prompt token in a step that carries a prefill, measured
        self.num_shed = 0

    # -- measuring (an engine step listener) ------------------------------------------------------

    def on_step(self, stats, _outputs) -> None:
        if not stats.num_seqs or stats.duration <= 0:
            return
        if not stats.num_prefill_tokens:
            self.step_s = stats.duration if not self.step_s else (1 - _EMA) * self.step_s + _EMA * stats.duration
        elif stats.num_prefill_tokens >= 8:
            per = max(stats.duration - (self.step_s if stats.num_decode_tokens else 0.0), 0.0) / stats.num_prefill_tokens
            self.token_s = per if not self.token_s else (1 - _EMA) * self.token_s + _EMA * per

    # -- predicting -------------------------------------------------------------------------------

    def prefill_s(self, seq: Sequence) -> float:
        """Predicted seconds until this sequence's first token, if it ran now."""
        left = max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
        return left * self.token_s + self.step_s

    def slack(self, seq: Sequence, now: float) -> float:
        slo = seq.params.slo
        if slo is None:
            return _NO_DEADLINE
        if seq.times.first_token is None:
            if slo.ttft_ms is None:
                return _NO_DEADLINE
            return seq.times.arrival + slo.ttft_ms / 1000 - now - self.prefill_s(seq)
        if slo.tpot_ms is None:
            return _NO_DEADLINE
        return seq.times.first_token + slo.tpot_ms / 1000 * seq.num_output_tokens - now - self.step_s

    def late(self, seq: Sequence, now: float) -> bool:
        """Can this sequence no longer meet every target of its SLO (predicted)?"""
        slo = seq.params.slo
        if slo is None:
            return False
        first = seq.times.first_token
        ttft_s = slo.ttft_ms / 1000 if slo.ttft_ms is not None else None
        left = max((seq.params.max_tokens or seq.num_output_tokens) - seq.num_output_tokens, 0)
        if first is None:
            if ttft_s is not None and now + self.prefill_s(seq) > seq.times.arrival + ttft_s:
                return True
            end = now + self.prefill_s(seq) + max(left - 1, 0) * self.step_s
        else:
            if ttft_s is not None and first - seq.times.arrival > ttft_s:
                return True
            end = now + left * self.step_s
            gaps = seq.num_output_tokens + left - 1
            if slo.tpot_ms is not None and gaps > 0 and (end - first) / gaps > slo.tpot_ms / 1000:
                return True
        return slo.e2e_ms is not None and end - seq.times.arrival > slo.e2e_ms / 1000

    def key(self, seq: Sequence, now: float) -> tuple:
        """The policy key (policies.py): on-time first, least slack first, then arrival."""
        return (self.late(seq, now), self.slack(seq, now), seq.times.arrival)

    def tpot_cap(self, running: list[Sequence], now: float) -> float | None:
        """Seconds this step may take and every decoding row with a TPOT target still keeps it: the least,
        over those rows, of the time until its next token is due (first token + tpot x tokens so far - now),
        but never less than the row's own target, or None when no row has one. A row ahead of its TPOT
        has banked time, and a step that spends it carries more prompt."""
        caps = [max(s.times.first_token + tpot * s.num_output_tokens - now, tpot) for s in running
                if s.times.first_token is not None and (tpot := _tpot_s(s)) is not None]
        return min(caps) if caps else None

    # -- shedding ---------------------------------------------------------------------------------

    def check_admission(self, seqs: list[Sequence], waiting: list[Sequence], running: list[Sequence],
                        max_num_seqs: int, now: float) -> None:
        """Refuse (SLOShedError) a new request predicted to miss its TTFT by more than SHED_MARGIN x: the
        wait is the longer of the prompt tokens ahead of it at the measured cost per token and, when the
        batch is full, the decode steps until as many seats free as requests are ahead of it."""
        seq = seqs[0]
        slo = seq.params.slo
        if slo is None or slo.ttft_ms is None or not self.token_s:
            return
        mine = self.key(seq, now)
        ahead = [s for s in waiting + running if s.times.first_token is None and self.key(s, now) < mine]
        wait_s = sum(max(s.num_prompt_tokens - s.num_computed_tokens, 0) for s in ahead) * self.token_s
        seats = sum(1 for s in ahead if s not in running) + len(seqs) - (max_num_seqs - len(running))
        if seats > 0 and running:  # the k-th seat frees when the k-th shortest remaining output ends
            left = sorted(max((s.params.max_tokens or 0) - s.num_output_tokens, 1) for s in running)
            rounds, k = divmod(seats - 1, len(left))
            wait_s = max(wait_s, (rounds * sum(left) / len(left) + left[k]) * self.step_s)
        predicted = now - seq.times.arrival + wait_s + self.prefill_s(seq) * len(seqs)
        if predicted > SHED_MARGIN * slo.ttft_ms / 1000:
            self.num_shed += 1
            retry = max(1, math.ceil(wait_s))
            raise SLOShedError(f"slo.ttft_ms: this request would take about {predicted * 1000:.0f} ms to its first "
                               f"token, over {SHED_MARGIN:g}x its target of {slo.ttft_ms:g} ms; retry in {retry} s",
                               retry)
