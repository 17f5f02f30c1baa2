"""Stall-free prefill sizing (Sarathi-Serve): how many prefill tokens a step may carry while other
sequences decode, from what this engine's own steps have measured.

`OnlineStepCost` listens to every step (its shape and duration) and refits a linear step-time model
(sim/cost_model.py's `fit_linear`, the simulator's) over a window of recent steps. The scheduler asks
`chunk_limit(...)` for each prefill chunk: the most tokens whose predicted step time stays within
`factor` times the same step without any prefill. A decoding stream's inter-token gap therefore grows by at
most `factor` while a long prompt prefills in slices, instead of waiting behind whole prefill chunks,
and the slice size follows the machine: more tokens where prefill is cheap, fewer where it is not.

Before the first fit (a cold engine) the allowance is `cold_chunk` tokens: small enough not to stall
anybody on a slow machine, and the steps it makes teach the model.
"""

from __future__ import annotations

from collections import deque

from ..sim.cost_model import LinearCostModel, fit_linear, step_features
from ..step import StepShape

FEATURES = ("tokens", "seqs", "prefill_seqs", "decode_kv", "prefill_attn")


class OnlineStepCost:
    def __init__(self, block_size: int, factor: float, *, window: int = 512, refit_every: int = 32,
                 min_samples: int = 24, cold_chunk: int = 64, min_chunk: int | None = None):
        self.block_size = block_size
        self.factor = factor
        self.samples: deque = deque(maxlen=window)
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.cold_chunk = cold_chunk
        self.min_chunk = min_chunk or block_size  # a prompt always moves on, whatever the prediction
        self.model: LinearCostModel | None = None
        self._since_fit = 0
        self._prefill_steps = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not shape.rows or seconds <= 0:
            return
        f = step_features(shape, self.block_size)
        self.samples.append((f, seconds))
        self._prefill_steps += f.prefill_seqs > 0
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self.samples) >= self.min_samples and self._prefill_steps:
            self._since_fit = 0
            try:
                self.model = fit_linear(list(self.samples), FEATURES, source="online")
            except (ValueError, ArithmeticError):  # degenerate window (all steps alike): keep the last fit
                pass

    def on_step(self, stats, _outputs) -> None:
        """An `LLMEngine` step listener."""
        self.observe(stats.shape, stats.duration)

    def predict(self, rows: list[tuple[int, int]]) -> float:
        assert self.model is not None
        return self.model.predict(step_features(StepShape(rows, len(rows), 0), self.block_size))

    def chunk_limit(self, decode_rows: list[tuple[int, int]], prefill_rows: list[tuple[int, int]],
                    computed: int, want: int) -> int:
        """Tokens the next prefill chunk may take (at most `want`) for a sequence with `computed` tokens
        already cached, beside this step's `decode_rows` [(1, context)] and the `prefill_rows` planned so
        far. The step's first chunk always gets at least `min_chunk`, so every prompt moves on."""
        if not decode_rows or want <= 0:
            return want
        floor = min(want, self.min_chunk) if not prefill_rows else 0
        if self.model is None:
            return max(min(want, self.cold_chunk - sum(n for n, _ in prefill_rows)), floor)
        limit = self.factor * self.predict(decode_rows)
        planned = decode_rows + prefill_rows
        lo, hi = 0, want  # the largest n whose step still fits the limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict([*planned, (mid, computed + mid)]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return max(lo, floor)
