"""Confidence signals over a tier's first tokens, and the logistic probe (issue 55).

Every signal is a confidence in [0, 1] (higher: the tier's answer more likely stands), computed from the
per-token logprobs the engine returns (each a dict of the top-N logprobs of the raw model output, the
sampled token always present):

- `min_top1`: the smallest top-1 probability over the tokens (the seed's "top token < 0.8");
- `p10_top1`: its 10th percentile (Gupta et al.: low quantiles beat the mean; less brittle than the min);
- `mean_logprob`: exp of the mean logprob of the sampled tokens (the geometric-mean probability);
- `entropy`: exp(-mean entropy). The entropy is approximated from the top-N only: the top-N terms plus
  the rest of the mass (1 - their sum) counted as one more outcome, a lower bound on the true entropy;
- `probe`: 1 - p(the tier fails) from a logistic regression on a pooled hidden state (`LogisticProbe`).

numpy only: the probe is a few hundred weights, fitted by Newton's method (no scikit-learn here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

TOKEN_SIGNALS = ("min_top1", "p10_top1", "mean_logprob", "entropy")
SIGNALS = (*TOKEN_SIGNALS, "probe")
CONFIDENCE_TOP_N = 20  # logprobs a tier is asked for: the entropy's top-N (the API's largest top_logprobs)


def token_signals(token_ids: Sequence[int], logprobs: Sequence[dict[int, float]]) -> dict[str, float]:
    """Every token signal over the tokens (all 1.0 for an empty answer: nothing was unsure)."""
    if not logprobs:
        return dict.fromkeys(TOKEN_SIGNALS, 1.0)
    top1 = np.array([math.exp(max(lp.values())) for lp in logprobs])
    chosen = np.array([lp.get(t, max(lp.values())) for t, lp in zip(token_ids, logprobs, strict=False)])
    entropies = []
    for lp in logprobs:
        p = np.exp(np.fromiter(lp.values(), float))
        rest = max(1.0 - p.sum(), 0.0)
        terms = np.append(p, rest)
        terms = terms[terms > 0]
        entropies.append(float(-(terms * np.log(terms)).sum()))
    return {
        "min_top1": float(top1.min()),
        "p10_top1": float(np.quantile(top1, 0.1)),
        "mean_logprob": float(math.exp(chosen.mean())),
        "entropy": float(math.exp(-float(np.mean(entropies)))),
    }


class LogisticProbe:
    """p(fail | x) = sigmoid(w . (x - mean) / scale + b), x a pooled hidden state."""

    def __init__(self, weights, bias: float, mean, scale):
        self.weights = np.asarray(weights, float)
        self.bias = float(bias)
        self.mean = np.asarray(mean, float)
        self.scale = np.asarray(scale, float)

    @classmethod
    def fit(cls, features: np.ndarray, failed: np.ndarray, l2: float = 1.0, steps: int = 50) -> LogisticProbe:
        """Newton's method on the L2-regularised log loss (the bias unregularised); `failed` 0/1."""
        x = np.asarray(features, float)
        y = np.asarray(failed, float)
        mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-6
        z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
        w = np.zeros(z.shape[1])
        reg = np.full(z.shape[1], l2)
        reg[-1] = 0.0
        for _ in range(steps):
            p = 1.0 / (1.0 + np.exp(-z @ w))
            grad = z.T @ (p - y) + reg * w
            hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(reg + 1e-9)
            step = np.linalg.solve(hess, grad)
            w -= step
            if np.abs(step).max() < 1e-8:
                break
        return cls(w[:-1], w[-1], mean, scale)

    def p_fail(self, x) -> float:
        z = (np.asarray(x, float) - self.mean) / self.scale
        return float(1.0 / (1.0 + math.exp(-float(z @ self.weights + self.bias))))

    def to_json(self) -> dict:
        def short(v):  # 7 significant digits: float32's, a third of the file
            return [float(f"{x:.7g}") for x in np.atleast_1d(v)]
        return {"weights": short(self.weights), "bias": self.bias, "mean": short(self.mean), "scale": short(self.scale)}

    @classmethod
    def from_json(cls, d: dict) -> LogisticProbe:
        return cls(d["weights"], d["bias"], d["mean"], d["scale"])


def auroc(scores: Sequence[float], positive: Sequence[bool]) -> float | None:
    """The probability that a positive scores above a negative (ties count half); None without both."""
    s = np.asarray(scores, float)
    y = np.asarray(positive, bool)
    pos, neg = s[y], s[~y]
    if not len(pos) or not len(neg):
        return None
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def threshold_for_rate(confidences: Sequence[float], rate: float) -> float:
    """The threshold at which a share `rate` of these confidences escalates (confidence < threshold)."""
    c = np.sort(np.asarray(confidences, float))
    if rate <= 0 or not len(c):
        return 0.0
    if rate >= 1:
        return 1.0
    i = min(round(rate * len(c)), len(c) - 1)
    return float(c[i])
