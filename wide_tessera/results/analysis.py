"""From timings to answers: speedups, the winner at each point, crossover N per group, threshold.

The rules, which the README repeats:

* A strategy's speedup at a point is baseline median / strategy median, with a
  95% bootstrap confidence interval over the paired, interleaved rounds. It is
  'faster' when the whole interval lies above 1 + MIN_EFFECT, 'slower' when it
  lies below 1 / (1 + MIN_EFFECT), else 'same': no significant difference.
* Fusing wins at a point when a correct strategy is 'faster'; `best_strategy`
  is then the fastest such one, else the correct strategy with the highest
  speedup. Incorrect strategies are never considered, nor are the controls
  (the loop captured in a CUDA graph or compiled): they are timed and shown
  beside the strategies, but they do not fuse, so they never win.
* A parameter group is all points that share every parameter but N. Its
  crossover is the smallest N of the sweep from which fusing wins at that N and
  at every larger N of the sweep; None when the largest N does not win.
* `crossover_n` of a result is the median of the groups' crossovers, counting a
  group that never crosses as infinitely late: the N from which fusing pays
  for at least half the configurations. None when fewer than half cross.
* `recommended_threshold` is the largest crossover among the groups that cross:
  from that N on, fusing wins in every configuration that ever wins. None when
  no group crosses.
* The confirmation pass measures the points that decide each group's crossover
  (the crossover point and the one just below it, or the largest N of a group
  that never crosses) and every point whose speedup interval comes within 1% of
  a margin, again and independently. Where the two passes disagree on the
  winner's class (a strategy, no difference, the baseline), the point is
  'unstable': it never counts as a win, so crossovers and thresholds rest on
  verdicts that agree. Newly deciding points are confirmed in turn.
* A point's `best_speedup`, and the result's, is the largest *significant*
  correct speedup (verdict 'faster', confirmed where confirmed); None when there
  is none. A number inside the noise is never a headline.
* A result is unreliable when a point's measurement was disturbed beyond
  cleaning (a busy machine, preempted or throttled rounds), a deciding point
  near the margin did not converge, or a point is unstable; the reasons are listed.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

from ..core.correctness import Check
from ..core.job import group_key, params_text
from ..core.roles import CONTROLS
from ..core.stats import MIN_EFFECT
from ..measurement.health import RunHealth
from ..measurement.timing import PairedTimings
from .schema import BenchmarkResult, Confirmation, Failure, FuseOrCapture, GroupResult, PointResult

__all__ = [
    "MIN_EFFECT",
    "IMPLAUSIBLE_SPEEDUP",
    "measured_point",
    "parameter_groups",
    "failed_point",
    "confirmed",
    "points_to_confirm",
    "result_of",
    "first_verdict",
    "fuse_or_capture",
    "speedup_ci",
    "verdict",
    "pick_best",
    "group_crossover",
    "overall_crossover",
    "recommended_threshold",
]

# A significant speedup above this is more often a broken comparison than a kernel
# (KernelBench flags the same): it is flagged for a second look.
IMPLAUSIBLE_SPEEDUP = 10.0
# A speedup interval within this fraction of a margin could fall either side next time.
NEAR_MARGIN = 0.01
# The unreliable groups an UNRELIABLE line names; the rest are counted.
_REASONS_SHOWN = 2


def speedup_ci(
    baseline_ms: Sequence[float], strategy_ms: Sequence[float], seed: int = 0, paired: Optional[bool] = None
) -> Tuple[float, float]:
    """95% bootstrap CI of median(baseline) / median(strategy).

    Samples of one run, of equal count, are paired by round (they were interleaved) and
    resampled together; otherwise, or with paired=False (two independent runs), each side
    is resampled on its own.
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
            paired=len(baseline_ms) == len(strategy_ms) if paired is None else paired,
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
    """The fastest correct significantly-faster strategy, else the correct one with the highest speedup.

    Controls are never picked: they do not fuse."""
    eligible = [s for s in speedups if correct.get(s, False) and s not in CONTROLS]
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


def measured_point(
    n: int,
    params: Dict[str, Any],
    timings: Optional[PairedTimings],
    checks: Dict[str, Check],
    seed: int = 0,
    peak_memory_bytes: Optional[Dict[str, int]] = None,
    failures: Optional[Dict[str, Failure]] = None,
    first_call_s: Optional[Dict[str, float]] = None,
) -> PointResult:
    """A point from its timings (None when the baseline could not be timed) and checks."""
    failures = dict(failures or {})
    if timings is None or "baseline" not in timings.stats:
        return failed_point(n, params, failures, checks, peak_memory_bytes)
    stats_ = timings.stats
    base = stats_["baseline"]
    medians = {s: st.median_ms for s, st in stats_.items()}
    speedups = {s: base.median_ms / st.median_ms for s, st in stats_.items() if s != "baseline"}
    cis = {s: list(speedup_ci(base.samples_ms, stats_[s].samples_ms, seed)) for s in speedups}
    verdicts = {s: verdict(ci) for s, ci in cis.items()}
    correct = _correctness(checks, failures)
    best = pick_best(speedups, verdicts, correct)
    flags = [
        f"{s}: {speedups[s]:.1f}x faster is implausibly large; check that it computes what the baseline does"
        for s in speedups  # a control is the loop itself made cheaper: 15x on a launch-bound GPU loop is its point
        if verdicts[s] == "faster" and speedups[s] > IMPLAUSIBLE_SPEEDUP and s not in CONTROLS
    ]
    flags += [f"{s}: {c.fallback}" for s, c in checks.items() if c.fallback]
    trusted = timings.health.cleaned
    return PointResult(
        n,
        params,
        medians,
        speedups,
        cis,
        verdicts,
        correct,
        best,
        _significant(best, speedups, verdicts) if trusted else None,
        checks,
        stats_,
        dict(peak_memory_bytes or {}),
        failures,
        winner=_winner(best, verdicts) if trusted else "disturbed",
        health=timings.health,
        flags=flags,
        first_call_s=dict(first_call_s or {}),
    )


def failed_point(
    n: int,
    params: Dict[str, Any],
    failures: Dict[str, Failure],
    checks: Optional[Dict[str, Check]] = None,
    peak_memory_bytes: Optional[Dict[str, int]] = None,
) -> PointResult:
    """A point with no timings: its setup or its baseline failed, or it was skipped."""
    checks = dict(checks or {})
    correct = _correctness(checks, failures)
    return PointResult(
        n, params, {}, {}, {}, {}, correct, None, None, checks, {}, dict(peak_memory_bytes or {}), failures
    )


def _correctness(checks: Dict[str, Check], failures: Dict[str, Failure]) -> Dict[str, bool]:
    """Strategy -> correct; a strategy that failed to run is not correct (one skipped is neither)."""
    correct = {s: c.correct for s, c in checks.items()}
    correct.update({s: False for s, f in failures.items() if s != "point" and f.kind != "skipped"})
    return correct


def _significant(best: Optional[str], speedups: Dict[str, float], verdicts: Dict[str, str]) -> Optional[float]:
    return speedups[best] if best is not None and verdicts[best] == "faster" else None


def _winner(best: Optional[str], verdicts: Dict[str, str]) -> str:
    if best is not None and verdicts[best] == "faster":
        return best
    if best is not None and verdicts[best] == "same":
        return "no_difference"
    return "baseline"


def _winner_class(winner: str) -> str:
    return winner if winner in ("baseline", "no_difference", "unstable", "disturbed", "failed") else "fused"


def confirmed(first: PointResult, second: PointResult) -> PointResult:
    """`first` with the confirmation pass's `second` measurement attached; 'unstable' where they disagree."""
    second_winner = second.winner if second.timings else "failed"
    agrees = _winner_class(second_winner) == _winner_class(first.winner)
    confirmation = Confirmation(
        second.timings, second.speedups, second.speedup_ci, second.verdicts, second_winner, agrees, second.health
    )
    if agrees:
        return dataclasses.replace(first, confirmation=confirmation)
    return dataclasses.replace(first, confirmation=confirmation, winner="unstable", best_speedup=None)


def parameter_groups(points: Sequence[PointResult]) -> Iterator[List[PointResult]]:
    """Points sharing every parameter but N, in N order; skipped points say nothing about crossovers."""
    groups: Dict[str, List[PointResult]] = {}
    for p in points:
        if "point" in p.failures and p.failures["point"].kind == "skipped":
            continue
        groups.setdefault(group_key(p.params), []).append(p)
    for ps in groups.values():
        yield sorted(ps, key=lambda p: p.n)


def _deciding(group: List[PointResult]) -> List[PointResult]:
    """The points that decide a group's crossover: it and the one below it, or the largest N if none."""
    cross = group_crossover([(p.n, p.fused_wins) for p in group])
    if cross is None:
        return group[-1:]
    i = [p.n for p in group].index(cross)
    return group[max(0, i - 1) : i + 1]


def _near_margin(point: PointResult) -> bool:
    bounds = (1 + MIN_EFFECT, 1 / (1 + MIN_EFFECT))
    return any(
        point.correct.get(s, False) and lo <= b * (1 + NEAR_MARGIN) and hi >= b / (1 + NEAR_MARGIN)
        for s, (lo, hi) in point.speedup_ci.items()
        for b in bounds
    )


def points_to_confirm(points: Sequence[PointResult], mode: str) -> List[PointResult]:
    """The measured, not yet confirmed points the confirmation pass takes again under `mode`."""
    if mode == "none":
        return []
    measured = [p for p in points if p.timings and p.confirmation is None]
    if mode == "all":
        return measured
    deciding = {id(p) for g in parameter_groups(points) for p in _deciding(g)}
    return [p for p in measured if id(p) in deciding or _near_margin(p)]


def result_of(points: List[PointResult], **run_info: Any) -> BenchmarkResult:
    """An op's result from its points: groups and crossovers, wins, headline, reliability."""
    group_results = []
    for ps in parameter_groups(points):
        deciding = {id(p) for p in _deciding(ps)}
        group_results.append(
            GroupResult(
                params=ps[0].params,
                n_values=[p.n for p in ps],
                crossover_n=group_crossover([(p.n, p.fused_wins) for p in ps]),
                problems=[f"N={p.n}: {why}" for p in ps for why in _point_problems(p, id(p) in deciding)],
                fuse_or_capture=fuse_or_capture(ps[-1]),
            )
        )
    crossovers = [g.crossover_n for g in group_results]
    speedups = [p.best_speedup for p in points if p.best_speedup is not None]
    troubled = [g for g in group_results if g.problems]
    reasons = [f"{params_text(g.params)}: {_problem_digest(g.problems)}" for g in troubled[:_REASONS_SHOWN]]
    if len(troubled) > _REASONS_SHOWN:
        reasons.append(f"and {len(troubled) - _REASONS_SHOWN} more of {len(group_results)} groups")
    return BenchmarkResult(
        points=points,
        groups=group_results,
        crossover_n=overall_crossover(crossovers),
        recommended_threshold=recommended_threshold(crossovers),
        strategy_wins=dict(Counter(p.winner for p in points if p.timings)),
        best_speedup=max(speedups) if speedups else None,
        reliable=not reasons,
        unreliable_reasons=reasons,
        health=RunHealth.of([p.health for p in points if p.health is not None]),
        **run_info,
    )


def fuse_or_capture(point: PointResult) -> Optional[FuseOrCapture]:
    """The point's best strategy against its fastest correct control, or None without both."""
    controls = [c for c in CONTROLS if c in point.stats and point.correct.get(c, False)]
    best = point.best_strategy
    if not controls or best is None or point.disturbed:
        return None
    control = min(controls, key=lambda c: point.timings[c])
    ci = list(speedup_ci(point.stats[control].samples_ms, point.stats[best].samples_ms))
    return FuseOrCapture(point.n, best, control, point.timings[control] / point.timings[best], ci, verdict(ci))


def _problem_digest(problems: List[str]) -> str:
    """'busy machine at N=1,4; unstable at N=16' from a group's 'N=1: busy machine: ...' lines."""
    where: Dict[str, List[str]] = {}
    for line in problems:
        n, _, text = line.partition(": ")
        where.setdefault(text.split(":")[0], []).append(n[2:])
    return "; ".join(f"{kind} at N={','.join(dict.fromkeys(ns))}" for kind, ns in where.items())


def _point_problems(point: PointResult, deciding: bool) -> List[str]:
    """Why this point's verdict may not be trusted: a disturbed measurement, disagreeing passes,
    or (where it decides a crossover) an interval near the margin that did not converge."""
    problems = [
        why
        for health in (point.health, point.confirmation.health if point.confirmation else None)
        if health is not None
        for why in health.problems
    ]
    if point.unstable:
        problems.append(f"unstable: first {first_verdict(point)}, then {point.confirmation.winner}")
    # An unconverged median widens the speedup's interval, which the verdict already takes
    # into account; it matters where that interval is close enough to a margin to tip.
    if deciding and point.timings and not _converged(point) and _near_margin(point):
        problems.append("unconverged near the margin: give a larger --budget or a quieter machine")
    return problems


def _converged(point: PointResult) -> bool:
    """The baseline's and the best strategy's medians reached the precision asked for."""
    timed = ["baseline"] + ([point.best_strategy] if point.best_strategy in point.stats else [])
    return all(point.stats[s].converged for s in timed)


def first_verdict(point: PointResult) -> str:
    """The first pass's verdict at a point, as the unstable-point messages quote it."""
    s = point.best_strategy
    if s is None or s not in point.verdicts:
        return "baseline"
    lo, hi = point.speedup_ci[s]
    return f"{s} {point.speedups[s]:.2f}x [{lo:.2f},{hi:.2f}]"
