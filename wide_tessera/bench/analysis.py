"""From timings to answers: speedups, the winner at each point, crossover N per group, threshold.

The rules, which the README repeats:

* A point's `best_strategy` is the fastest *correct* wide strategy; fusing wins
  at that point when its speedup (baseline median / strategy median) is > 1.
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
from typing import Dict, Optional, Sequence, Tuple

__all__ = ["best_of", "group_crossover", "overall_crossover", "recommended_threshold"]


def best_of(
    timings: Dict[str, float], correct: Dict[str, bool]
) -> Tuple[Dict[str, float], Optional[str], Optional[float]]:
    """Speedups of every timed wide strategy, and the fastest correct one with its speedup."""
    base = timings["baseline"]
    speedups = {s: base / t for s, t in timings.items() if s != "baseline"}
    eligible = [s for s in speedups if correct.get(s, False)]
    if not eligible:
        return speedups, None, None
    best = max(eligible, key=lambda s: speedups[s])
    return speedups, best, speedups[best]


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
