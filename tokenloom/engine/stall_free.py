"""Stall-free prefill sizing (Sarathi-Serve): how many prefill tokens a step may carry while other
sequences decode, steered by what this engine's own steps measure.

Two measured things, updated after every step:
- the decode-only step time: a linear model (cost_model.py's `fit_linear`, the simulator's too) of the
  steps that carried no prefill, on the sequences decoded and the context tokens they read; it
  predicts what any step's decodes alone would cost, also while every step carries a prefill slice;
- the prefill allowance (tokens a step may add beside decodes): after each step that carried
  both, scaled by how far the step's time was from its target, `factor` x its decodes' predicted
  time (a step over target shrinks it, one under target and limited by it grows it, at most 2x).

A feedback loop rather than a fitted prefill cost, because a prefill slice's cost is not linear: it
grows with the prompt's context (attention), and a long slice switches its matmuls to the dense
kernel (runner.SHORT_CHUNK). The decoding streams' inter-token gap thus grows by about `factor` while
a long prompt prefills in slices; the prompt moves on by at least `min_chunk` tokens a step.

Under `--scheduling-policy slo` the scheduler sets `tpot_cap` each step from the rows decoding (the time
until the most pressed one's next token is due, never under its TPOT target; slo_policy.py): the step's
target is then at most that many seconds (a factor of infinity: only it).

Until the engine has seen enough decode-only steps to fit their cost there is no cap (the fixed token
budget applies): a workload that always has prompts waiting never stops to teach it, and then keeps
the throughput of whole chunks.
"""

from __future__ import annotations

import math
from collections import deque

from ..step import StepShape
from .cost_model import LinearCostModel, fit_linear, step_features

DECODE_FEATURES = ("seqs", "kv_read")


class StallFreeBudget:
    def __init__(self, block_size: int, factor: float, *, max_tokens: int = 512, start_tokens: int = 16,
                 min_chunk: int = 1, window: int = 256, refit_every: int = 8, min_samples: int = 8):
        self.block_size = block_size
        self.factor = factor
        self.max_tokens = max_tokens
        self.allowance = start_tokens
        self.min_chunk = min_chunk
        self.decode_steps: deque = deque(maxlen=window)  # (features, seconds) of decode-only steps
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.decode_model: LinearCostModel | None = None
        self._since_fit = 0
        self.tpot_cap: float | None = None  # seconds a step may take at most (the slo policy sets it per step)

    # -- measuring -------------------------------------------------------------------------------

    def planned(self, decode_rows: list[tuple[int, int]], prefill_tokens: int) -> None:
        """The scheduler's plan for the step about to run: its decoding sequences [(1, context)] and the
        prompt tokens it carries beside them (a one-token slice of a prompt counts here, not as a decode)."""
        self._plan = (decode_rows, prefill_tokens)

    def on_step(self, stats, _outputs) -> None:
        """An `LLMEngine` step listener: the step just run is the one last planned."""
        decode_rows, prefill = getattr(self, "_plan", ([], 0))
        self._plan = ([], 0)
        self.observe(stats.shape, stats.duration, decode_rows, prefill)

    def observe(self, shape: StepShape, seconds: float, decode_rows: list[tuple[int, int]], prefill: int) -> None:
        if not decode_rows or seconds <= 0:
            return
        if not prefill:
            self.decode_steps.append((step_features(shape, self.block_size), seconds))
            self._since_fit += 1
            if self._since_fit >= self.refit_every and len(self.decode_steps) >= self.min_samples:
                self._since_fit = 0
                try:
                    self.decode_model = fit_linear(list(self.decode_steps), DECODE_FEATURES, source="online")
                except (ValueError, ArithmeticError):  # degenerate window: keep the last fit
                    pass
            return
        if self.decode_model is None or math.isinf(target := self.target(decode_rows)):
            return
        ratio = seconds / target
        if ratio > 1:
            self.allowance = max(self.min_chunk, int(prefill / ratio * 0.9))
        elif prefill >= self.allowance:  # the step was limited by the allowance and had time to spare
            self.allowance = min(self.max_tokens, max(prefill + 1, min(2 * prefill, int(prefill / ratio * 0.9))))

    def target(self, decode_rows: list[tuple[int, int]]) -> float:
        """Seconds a step of these decode rows plus a prefill slice should take: `factor` x the rows alone,
        at most `tpot_cap` — unless the rows alone already take longer: a cap no step can meet would cut
        every prompt to `min_chunk` and help none of them."""
        alone = self.decode_time(decode_rows)
        goal = self.factor * alone
        return goal if self.tpot_cap is None or self.tpot_cap <= alone else min(goal, self.tpot_cap)

    def decode_time(self, decode_rows: list[tuple[int, int]]) -> float:
        """Predicted seconds of a step of these decode rows [(1, context)] alone."""
        assert self.decode_model is not None
        shape = StepShape(decode_rows, len(decode_rows), 0)
        return max(self.decode_model.predict(step_features(shape, self.block_size)), 1e-6)

    # -- deciding --------------------------------------------------------------------------------

    def chunk_limit(self, decoding: bool, planned_prefill: int, want: int) -> int:
        """Tokens the next prefill chunk may take (at most `want`), when `planned_prefill` prefill tokens
        are already in this step. Nobody decoding: all of `want`. The step's first chunk gets at least
        `min_chunk`, so a prompt moves on every step. No cap before the decode cost is known."""
        if not decoding or want <= 0 or self.decode_model is None or (math.isinf(self.factor) and self.tpot_cap is None):
            return want
        floor = min(want, self.min_chunk) if planned_prefill == 0 else 0
        return max(min(want, self.allowance - planned_prefill), floor)
