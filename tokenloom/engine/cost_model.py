"""Step-time cost: what one `LLMEngine.step()` costs, from the batch shape, as a linear model fitted to
measured steps. The engine's stall-free budget (stall_free.py) fits it online; the simulator
(tokenloom/sim) runs on it or on a roofline preset (sim/cost_model.py).

`step_features(shape)` describes the batch shape of a planned step (`StepPlan.shape`, `StepStats.shape`):

- ``tokens``: tokens computed (rows through every matmul of the model body);
- ``sampled``: sequences that sample a token (rows through the LM head, the sampler, the detokenizer);
- ``seqs`` / ``prefill_seqs``: sequences in the step / those with a multi-token chunk (per-sequence
  bookkeeping and one attention call per prefill chunk);
- ``decode_kv``: decode sequences × their longest context, rounded up to whole blocks (the decode
  attention reads a padded [decodes, longest context] gather of the cache);
- ``prefill_attn``: query-key pairs of the prefill chunks, sum of chunk length × context;
- ``attn_pairs`` / ``kv_read``: query-key pairs / context tokens read, over all sequences, unpadded;
- ``swap_blocks``: KV blocks copied to or from the host pool.

`LinearCostModel` (``kind: linear``) — step time = intercept + Σ coef·feature, fitted by non-negative
least squares on relative error (`fit_linear`) on measured (features, duration) pairs; `tokenloom calibrate` makes one.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import numpy as np

from ..step import StepShape, is_decode

LINEAR_FEATURES = ("tokens", "sampled", "seqs", "prefill_seqs", "decode_kv", "prefill_attn")


@dataclass
class StepFeatures:
    tokens: int = 0
    sampled: int = 0
    seqs: int = 0
    prefill_seqs: int = 0
    decode_kv: int = 0
    prefill_attn: int = 0
    attn_pairs: int = 0
    kv_read: int = 0
    swap_blocks: int = 0

    def vector(self, names: tuple[str, ...]) -> list[float]:
        return [float(getattr(self, n)) for n in names]


def step_features(shape: StepShape, block_size: int) -> StepFeatures:
    f = StepFeatures(sampled=shape.num_sampled, swap_blocks=shape.num_swap_blocks)
    decodes, longest = 0, 0
    for n, ctx in shape.rows:
        f.tokens += n
        f.seqs += 1
        f.attn_pairs += n * ctx
        f.kv_read += ctx
        if is_decode(n):
            decodes += 1
            longest = max(longest, ctx)
        else:
            f.prefill_seqs += 1
            f.prefill_attn += n * ctx
    f.decode_kv = decodes * (-(-longest // block_size) * block_size)
    return f


# -- the measured model -----------------------------------------------------------------------------


@dataclass
class LinearCostModel:
    intercept: float
    coef: dict[str, float]
    fit_stats: dict = field(default_factory=dict)  # samples, r2, median/p90 relative error of the fit
    source: str = ""
    # Measured / predicted step time at evenly spaced quantiles (0%, ..., 100%) over the fitted steps, or
    # empty: a served engine's steps vary with what else runs on the machine, and `step_time` draws from
    # that spread (see `with_spread`). Empty: every step takes its prediction.
    spread: list[float] = field(default_factory=list)

    kind = "linear"

    def predict(self, f: StepFeatures) -> float:
        return self.intercept + sum(c * getattr(f, name) for name, c in self.coef.items())

    def step_time(self, f: StepFeatures, rng: random.Random) -> float:
        """One step's time: the prediction scaled by a draw from the measured spread."""
        if not self.spread:
            return self.predict(f)
        return self.predict(f) * float(np.interp(rng.random(), np.linspace(0, 1, len(self.spread)), self.spread))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "intercept": self.intercept, "coef": self.coef,
                "fit_stats": self.fit_stats, "source": self.source, "spread": self.spread}


def with_spread(model: LinearCostModel, samples: list[tuple[StepFeatures, float]],
                quantiles: int = 101) -> LinearCostModel:
    """`model` with the spread of measured / predicted over `samples`, all of them (the fit drops a
    shared machine's hiccups; a served engine's hiccups are part of what its requests wait for)."""
    ratios = np.array([d / model.predict(f) for f, d in samples])
    return dataclasses.replace(model, spread=[float(q) for q in np.quantile(ratios, np.linspace(0, 1, quantiles))])


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares, min |a x - b| with x >= 0 (Lawson & Hanson's active-set method)."""
    _m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=0) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit_linear(
    samples: list[tuple[StepFeatures, float]], names: tuple[str, ...] = LINEAR_FEATURES, source: str = ""
) -> LinearCostModel:
    """Fit intercept + coefficients (all >= 0) to (features, seconds) pairs, minimising *relative* error
    (rows weighted by 1/duration, so 20 ms decode steps count as much as 1 s prefill steps: TPOT and
    TTFT depend on both). Steps off the first fit by more than max(25%, 3x its median error) — a shared
    machine's hiccups — are dropped once and the model refitted."""
    if len(samples) < len(names) + 1:
        raise ValueError(f"samples: need at least {len(names) + 1} steps to fit, got {len(samples)}")
    x = np.array([[1.0, *f.vector(names)] for f, _ in samples])
    y = np.array([d for _, d in samples])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):
        xw, yw = x[keep] / y[keep, None], np.ones(keep.sum())
        scale = np.abs(xw).max(axis=0)
        scale[scale == 0] = 1.0
        w = nnls(xw / scale, yw) / scale
        rel = np.abs(x @ w - y) / np.maximum(y, 1e-9)
        keep = rel <= max(0.25, 3 * float(np.median(rel)))
    pred = x @ w
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    stats = {
        "samples": len(samples),
        "outliers_dropped": int((~keep).sum()),
        "r2": 1.0 - float(((pred - y) ** 2).sum()) / ss_tot,
        "median_rel_error": float(np.median(rel)),
        "p90_rel_error": float(np.percentile(rel, 90)),
    }
    return LinearCostModel(float(w[0]), {n: float(c) for n, c in zip(names, w[1:], strict=True)}, stats, source)
