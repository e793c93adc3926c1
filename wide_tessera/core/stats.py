"""Summary statistics of timing samples, with their uncertainty; the samples themselves are kept."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import numpy as np
from dataclasses_json import dataclass_json
from numpy.typing import ArrayLike
from scipy import special

__all__ = [
    "TimingStats",
    "median_ci",
    "median_ci_rel_width",
    "paired_ratio",
    "HIGH_CV",
    "MIN_EFFECT",
    "MARGINAL_ZONE",
    "REGRET",
]

# Above this coefficient of variation a timing is flagged as noisy.
HIGH_CV = 0.10
# A win must clear 5%, not just 1.0: between separate runs on a shared machine, speedups
# move by a few percent even when each run's interval is tight (scripts/repeatability.py:
# conv1d at N=1, one conv either way, came out 1.03x [1.02, 1.05] in one run and within
# noise in the next). A gain that small is no reason to fuse, and not reproducible.
MIN_EFFECT = 0.05
# The zone around the margin (1.05/1.02 to 1.05*1.02): two strategies whose ratio is known to
# lie within it tie (results.decisions), and, by the rule before regret bounds, a speedup known
# to lie within it was marginal.
MARGINAL_ZONE = 0.02
# A decision is settled once the worst a wrong choice can cost beyond the margin is at most
# this (RunSettings.regret's default): the cost the marginal zone accepted on either side, now
# asked of one side, the one the point chooses (scripts/regret.py).
REGRET = 0.02


def median_ci(samples: ArrayLike, confidence: float = 0.95) -> Tuple[float, float]:
    """A distribution-free confidence interval of the median, from order statistics.

    The number of samples below the true median is Binomial(n, 1/2), so the sorted
    samples at its two tail quantiles bracket the median with at least `confidence`.
    Too few samples for that confidence give the full range.
    """
    a = np.sort(np.asarray(samples, dtype=np.float64))
    n = len(a)
    lo = _lower_rank(n, confidence)
    hi = n - lo + 1
    if lo < 1:
        return float(a[0]), float(a[-1])
    return float(a[lo - 1]), float(a[hi - 1])


@functools.lru_cache(maxsize=None)
def _lower_rank(n: int, confidence: float) -> int:
    """1-based rank of the lower bound: the binomial(n, 1/2) quantile at (1 - confidence) / 2, the
    first count whose CDF reaches it. scipy.special's CDF, not scipy.stats' binom.ppf, which gave
    the same ranks for every n to 3000 at eight levels: importing scipy.stats cost each command
    about 1 s of its start (0.25 s for scipy.special, beside torch; 2-core CPU). Cached: the
    timer asks after every round, and this costs more than the sort."""
    cdf = special.bdtr(np.arange(n + 1), n, 0.5)
    return int(np.searchsorted(cdf, (1 - confidence) / 2))


def paired_ratio(
    numerator_ms: Sequence[float], denominator_ms: Sequence[float], confidence: float = 0.95
) -> Tuple[float, float, float]:
    """The median of the per-round ratios numerator/denominator of two functions timed in the
    same rounds, with a distribution-free confidence interval (median_ci's order statistics).

    Pairing by round cancels what a round shares (the machine's speed drifting, another
    process's burst), so the interval is narrower than one from the two medians apart; and the
    order-statistic interval holds its level at any number of rounds, where a bootstrap of ten
    rounds undercovers. At 10 rounds and the decision rule's 99.4% it is [min, max]: the
    ten ratios must all agree. Samples pair by round index; where one side was sampled in
    fewer rounds (dropped once its part was settled), the first rounds of the other pair with it."""
    k = min(len(numerator_ms), len(denominator_ms))  # one left out of later rounds pairs with the first k
    ratios = np.asarray(numerator_ms[:k], dtype=np.float64) / np.asarray(denominator_ms[:k], dtype=np.float64)
    lo, hi = median_ci(ratios, confidence)
    return float(np.median(ratios)), lo, hi


def median_ci_rel_width(samples: Sequence[float]) -> float:
    """Width of the median's 95% CI as a fraction of the median (inf for a zero median)."""
    lo, hi = median_ci(samples)
    return _rel_width(lo, hi, float(np.median(samples)))


def _rel_width(lo: float, hi: float, median: float) -> float:
    return (hi - lo) / median if median > 0 else float("inf")


@dataclass_json
@dataclass(frozen=True)
class TimingStats:
    """One measured function: every sample (ms per call) and the statistics drawn from them.

    The statistics are stored, not only derived, so a saved JSON file can be read
    without this package; `from_samples` is the one place that computes them.
    Outliers (beyond 1.5 IQR from the quartiles) are counted, never dropped.
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
    p10_ms: float
    p90_ms: float
    p99_ms: float
    median_ci_ms: List[float]
    cv: float
    outliers: int
    converged: bool = True
    warnings: List[str] = field(default_factory=list)
    # The function's place in each round (0 = first), sample by sample: the order rotates.
    positions: List[int] = field(default_factory=list)

    @classmethod
    def from_samples(
        cls,
        samples_ms: Sequence[float],
        timer: str,
        calls_per_sample: int = 1,
        converged: bool = True,
        positions: Sequence[int] = (),
    ) -> "TimingStats":
        if len(samples_ms) == 0:
            raise ValueError("no timing samples")
        a = np.asarray(samples_ms, dtype=np.float64)
        p10, q1, median, q3, p90, p99 = np.percentile(a, [10, 25, 50, 75, 90, 99])
        iqr = q3 - q1
        mean = a.mean()
        std = a.std(ddof=1) if len(a) > 1 else 0.0
        cv = std / mean if mean > 0 else 0.0
        lo, hi = median_ci(a)
        warnings: List[str] = []
        if cv > HIGH_CV:
            warnings.append(f"high spread: coefficient of variation {cv:.1%} (above {HIGH_CV:.0%})")
        if not converged:
            warnings.append(
                f"did not converge: the median's 95% CI spans {_rel_width(lo, hi, median):.1%} of it "
                f"after {len(a)} samples"
            )
        return cls(
            timer=timer,
            samples_ms=[float(x) for x in a],
            calls_per_sample=calls_per_sample,
            n_samples=len(a),
            median_ms=float(median),
            mean_ms=float(mean),
            std_ms=float(std),
            min_ms=float(a.min()),
            max_ms=float(a.max()),
            iqr_ms=float(iqr),
            p10_ms=float(p10),
            p90_ms=float(p90),
            p99_ms=float(p99),
            median_ci_ms=[lo, hi],
            cv=float(cv),
            outliers=int(((a < q1 - 1.5 * iqr) | (a > q3 + 1.5 * iqr)).sum()),
            converged=converged,
            warnings=warnings,
            positions=list(positions),
        )

    @property
    def median_ci_rel_width(self) -> float:
        """Width of the median's 95% CI as a fraction of the median."""
        lo, hi = self.median_ci_ms
        return _rel_width(lo, hi, self.median_ms)
