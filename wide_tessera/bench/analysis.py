"""From timings to answers: speedups, the winner at each point, crossover N per group, threshold.

The rules, which the README repeats:

* A strategy's speedup at a point is baseline median / strategy median, with a
  95% bootstrap confidence interval over the paired, interleaved rounds. It is
  'faster' when the whole interval lies above 1 + MIN_EFFECT, 'slower' when it
  lies below 1 / (1 + MIN_EFFECT), else 'same': no significant difference.
* Fusing wins at a point when a correct strategy is 'faster'; `best_strategy`
  is then the fastest such one, else the correct strategy with the highest
  speedup. Incorrect strategies are never considered.
* A parameter group is all points that share every parameter but N. Its
  crossover is the smallest N of the sweep from which fusing wins at that N and
  at every larger N of the sweep; None when the largest N does not win.
* `crossover_n` of a result is the median of the groups' crossovers, counting a
  group that never crosses as infinitely late: the N from which fusing pays
  for at least half the configurations. None when fewer than half cross.
* `recommended_threshold` is the largest crossover among the groups that cross:
  from that N on, fusing wins in every configuration that ever wins. None when
  no group crosses.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

__all__ = [
    "MIN_EFFECT",
    "speedup_ci",
    "verdict",
    "pick_best",
    "group_crossover",
    "overall_crossover",
    "recommended_threshold",
]

# A win must clear 5%, not just 1.0: between separate runs on a shared machine, speedups
# move by a few percent even when each run's interval is tight (scripts/repeatability.py:
# conv1d at N=1, one conv either way, came out 1.03x [1.02, 1.05] in one run and within
# noise in the next). A gain that small is no reason to fuse, and not reproducible.
MIN_EFFECT = 0.05


def speedup_ci(baseline_ms: Sequence[float], strategy_ms: Sequence[float], seed: int = 0) -> Tuple[float, float]:
    """95% bootstrap CI of median(baseline) / median(strategy).

    Samples of equal count are paired by round (they were interleaved) and resampled
    together; otherwise each side is resampled on its own.
    """
    if min(len(baseline_ms), len(strategy_ms)) < 2:
        raise ValueError("a speedup's confidence interval needs at least 2 samples on each side")

    def ratio(b: np.ndarray, s: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.median(b, axis=axis) / np.median(s, axis=axis)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # identical samples make a degenerate, but valid, interval
        res = stats.bootstrap(
            (np.asarray(baseline_ms), np.asarray(strategy_ms)),
            ratio,
            paired=len(baseline_ms) == len(strategy_ms),
            vectorized=True,
            n_resamples=2000,
            confidence_level=0.95,
            method="percentile",
            random_state=np.random.default_rng(seed),
        )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def verdict(ci: Sequence[float]) -> str:
    """'faster', 'slower' or 'same' (no significant difference) from a speedup's CI."""
    low, high = ci
    if low > 1 + MIN_EFFECT:
        return "faster"
    if high < 1 / (1 + MIN_EFFECT):
        return "slower"
    return "same"


def pick_best(speedups: Dict[str, float], verdicts: Dict[str, str], correct: Dict[str, bool]) -> Optional[str]:
    """The fastest correct significantly-faster strategy, else the correct one with the highest speedup."""
    eligible = [s for s in speedups if correct.get(s, False)]
    pool = [s for s in eligible if verdicts[s] == "faster"] or eligible
    return max(pool, key=lambda s: speedups[s]) if pool else None


def group_crossover(wins_by_n: Sequence[Tuple[int, bool]]) -> Optional[int]:
    """Smallest N from which every N (itself and all larger) wins; None if the largest N loses."""
    crossover = None
    for n, wins in sorted(wins_by_n, reverse=True):
        if not wins:
            break
        crossover = n
    return crossover


def overall_crossover(crossovers: Sequence[Optional[int]]) -> Optional[int]:
    """Median of the group crossovers, a non-crossing group counting as infinity (lower median)."""
    if not crossovers:
        return None
    ordered = sorted(math.inf if c is None else c for c in crossovers)
    median = ordered[(len(ordered) - 1) // 2]
    return None if median == math.inf else int(median)


def recommended_threshold(crossovers: Sequence[Optional[int]]) -> Optional[int]:
    crossed = [c for c in crossovers if c is not None]
    return max(crossed) if crossed else None
