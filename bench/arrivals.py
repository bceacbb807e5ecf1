"""When each request is sent: offsets (seconds from the start) of an arrival process.

Inter-arrival gaps are gamma distributed with shape = burstiness and mean
1/rate. burstiness 1 is a Poisson process (exponential gaps); below 1 the
arrivals come in bursts, above 1 they are more evenly spaced. rate = inf sends
everything at once (offsets all 0), which with --max-concurrency C becomes a
closed loop of C requests in flight.
"""
from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n non-decreasing offsets; the first request goes at 0."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # mean of gamma(k, theta) is k * theta = 1 / rate
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets
