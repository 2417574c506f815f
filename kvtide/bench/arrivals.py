"""When each request of a serving benchmark starts: the arrival process both load generators use."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_jobs: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Start time of each job, seconds from the first: gamma intervals with mean 1/rate."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_jobs
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_jobs)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
