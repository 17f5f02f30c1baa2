"""Request arrival schedule for the load generator, as `vllm bench serve` draws it.

- rate ``inf``: every request is sent at t = 0 (all at once).
- otherwise each inter-arrival gap ~ Gamma(shape=burstiness, scale=1 / (rate * burstiness)), so the mean
  gap is 1/rate; burstiness 1 is a Poisson process, < 1 burstier, > 1 more even (``inf``: constant
  1/rate). The first request also waits one gap. The cumulative times are then rescaled so that the
  last arrival lands exactly at N / rate (removes the 1-2% seed-to-seed drift of the sum).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start of the run, non-decreasing, one per request."""
    if num_requests <= 0:
        return []
    if not rate > 0:
        raise ValueError(f"request rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times = times * ((num_requests / rate) / times[-1])
    return [float(t) for t in times]
