"""Summary statistics of timing samples; the samples themselves are kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
from dataclasses_json import dataclass_json

__all__ = ["TimingStats"]


@dataclass_json
@dataclass(frozen=True)
class TimingStats:
    """One measured function: every sample (ms per call) and the statistics drawn from them.

    The statistics are stored, not only derived, so a saved JSON file can be read
    without this package; `from_samples` is the one place that computes them.
    """

    timer: str
    samples_ms: List[float]
    calls_per_sample: int
    n_samples: int
    median_ms: float
    mean_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    iqr_ms: float

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float], timer: str, calls_per_sample: int = 1) -> "TimingStats":
        if len(samples_ms) == 0:
            raise ValueError("no timing samples")
        a = np.asarray(samples_ms, dtype=np.float64)
        q1, median, q3 = np.percentile(a, [25, 50, 75])
        return cls(
            timer=timer,
            samples_ms=[float(x) for x in a],
            calls_per_sample=calls_per_sample,
            n_samples=len(a),
            median_ms=float(median),
            mean_ms=float(a.mean()),
            std_ms=float(a.std(ddof=1)) if len(a) > 1 else 0.0,
            min_ms=float(a.min()),
            max_ms=float(a.max()),
            iqr_ms=float(q3 - q1),
        )
