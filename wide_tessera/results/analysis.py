"""From timings to answers: speedups, the winner at each point, crossover N per group, threshold.

The rules, which the README repeats:

* A strategy's speedup at a point is the median of the paired, interleaved
  rounds' ratios baseline / strategy, with its distribution-free interval at the
  decision's level (`core.stats.paired_ratio`, `results.decisions`): the one
  interval everything that shows a speedup prints. It is 'faster' when the whole
  interval lies above 1 + MIN_EFFECT, 'slower' when it lies below
  1 / (1 + MIN_EFFECT), else 'same': no significant difference.
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
  verdicts that agree. Where both passes are clean, each interval spans both
  passes' intervals, and the verdicts and the decision follow it by the rule of
  one pass (`results.passes`): marginal only where the span lies within the
  zone. Passes that contradict each other, or where one cleared the margin and
  the span leaves the point open, get a third pass (`passes.disputed`,
  `passes.settled_by_third`). Newly deciding points are confirmed in turn.
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
from collections import Counter
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..core.correctness import Check
from ..core.job import group_key, params_text
from ..core.roles import BASELINE, CONTROLS
from ..core.stats import MIN_EFFECT, REGRET, paired_ratio
from ..measurement.health import RunHealth
from ..measurement.timing import PairedTimings
from .decisions import (
    UNUSABLE,
    Decision,
    Kind,
    decide,
    decide_capture,
    kind_of,
    unusable,
)
from .reliability import feeds_of, judge
from .schema import (
    DISTURBED,
    MARGINAL,
    NO_DIFFERENCE,
    OPEN,
    BenchmarkResult,
    Failure,
    FuseOrCapture,
    GroupResult,
    PointResult,
)

__all__ = [
    "MIN_EFFECT",
    "IMPLAUSIBLE_SPEEDUP",
    "measured_point",
    "parameter_groups",
    "failed_point",
    "reported_kind",
    "significant_speedup",
    "winner_of",
    "interval_text",
    "result_of",
    "first_verdict",
    "fuse_or_capture",
    "verdict",
    "pick_best",
    "group_crossover",
    "falls",
    "overall_crossover",
    "recommended_threshold",
]

# A significant speedup above this is more often a broken comparison than a kernel
# (KernelBench flags the same): it is flagged for a second look.
IMPLAUSIBLE_SPEEDUP = 10.0
# The unreliable groups an UNRELIABLE line names; the rest are counted.
_REASONS_SHOWN = 2


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


def falls(group: Sequence[PointResult]) -> Tuple[List[int], List[str]]:
    """Where a group's decisions (in N order) say that the speedup falls as N grows, which a
    crossover assumes it does not: the Ns decided loop (settled, by a measurement that was
    neither disturbed nor contradicted) above an N that fuses, and a note that says so. The
    crossover is then read above the last of them (group_crossover), the conservative reading:
    a fuse below a settled loop is not taken to mean that fusing pays from there on."""
    fused: List[int] = []
    at: List[int] = []
    for p in group:
        if p.fused_wins:
            fused.append(p.n)
        elif fused and _settled_loop(p):
            at.append(p.n)
    if not at:
        return [], []
    below = [n for n in fused if n < at[-1]]
    return at, [
        f"N={','.join(map(str, at))}: the speedup falls as N grows: the loop here, where N={','.join(map(str, below))} "
        f"fuses; a crossover assumes it does not fall, and is read above N={at[-1]}"
    ]


def _settled_loop(point: PointResult) -> bool:
    return not (point.unstable or point.disturbed) and point.decision is not None and point.decision.kind == "loop"


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
    level: float = 0.95,
    peak_memory_bytes: Optional[Dict[str, int]] = None,
    failures: Optional[Dict[str, Failure]] = None,
    first_call_s: Optional[Dict[str, float]] = None,
    epsilon: Optional[float] = REGRET,
) -> PointResult:
    """A point from its timings (None when the baseline could not be timed) and checks: every
    speedup the median of the paired rounds' ratios with its interval at `level`, and the
    point's decision (results.decisions) at regret `epsilon`. A function whose rounds hold a
    time no decision can be drawn from (decisions.unusable) has failed, and the baseline's
    failure is the point's."""
    failures = dict(failures or {})
    if timings is None or BASELINE not in timings.stats:
        return failed_point(n, params, failures, checks, peak_memory_bytes)
    bad = unusable({f: st.samples_ms for f, st in timings.stats.items()})
    for f, times in bad.items():
        failures["point" if f == BASELINE else f] = _unusable(f, times, len(timings.stats[f].samples_ms))
    if BASELINE in bad:
        return failed_point(n, params, failures, checks, peak_memory_bytes)
    stats_ = {f: st for f, st in timings.stats.items() if f not in bad}
    base = stats_[BASELINE]
    medians = {s: st.median_ms for s, st in stats_.items()}
    ratios = {s: paired_ratio(base.samples_ms, st.samples_ms, level) for s, st in stats_.items() if s != BASELINE}
    speedups = {s: r[0] for s, r in ratios.items()}
    cis = {s: [r[1], r[2]] for s, r in ratios.items()}
    verdicts = {s: verdict(ci) for s, ci in cis.items()}
    correct = _correctness(checks, failures)
    best = pick_best(speedups, verdicts, correct)
    decision = point_decision(
        {s: st.samples_ms for s, st in stats_.items()},
        _fusing(speedups, correct),
        [s for s in speedups if correct.get(s, False) and s in CONTROLS],
        level,
        epsilon,
    )
    trusted = timings.health.cleaned
    return PointResult(
        n=n,
        params=params,
        timings=medians,
        speedups=speedups,
        speedup_ci=cis,
        verdicts=verdicts,
        correct=correct,
        best_strategy=best,
        best_speedup=significant_speedup(best, speedups, verdicts) if trusted else None,
        checks=checks,
        stats=stats_,
        peak_memory_bytes=dict(peak_memory_bytes or {}),
        failures=failures,
        winner=winner_of(best, verdicts, decision) if trusted else DISTURBED,
        health=timings.health,
        flags=_flags(speedups, verdicts, checks),
        first_call_s=dict(first_call_s or {}),
        decision=decision,
    )


def _flags(speedups: Dict[str, float], verdicts: Dict[str, str], checks: Dict[str, Check]) -> List[str]:
    """What a point flags for a second look: an implausibly large significant speedup, and a
    strategy that did not really fuse (vmap ran a per-model loop)."""
    flags = [
        f"{s}: {speedups[s]:.1f}x faster is implausibly large; check that it computes what the baseline does"
        for s in speedups  # a control is the loop itself made cheaper: 15x on a launch-bound GPU loop is its point
        if verdicts[s] == "faster" and speedups[s] > IMPLAUSIBLE_SPEEDUP and s not in CONTROLS
    ]
    return flags + [f"{s}: {c.fallback}" for s, c in checks.items() if c.fallback]


def _unusable(function: str, times: List[float], rounds: int) -> Failure:
    """The failure of a function whose rounds hold times no decision can be drawn from
    (decisions.unusable): the point is decided without it, or (the baseline) not at all."""
    said = ", ".join(dict.fromkeys(f"{t:g} ms" for t in times))
    return Failure(
        "measure", "error", UNUSABLE,
        f"{function} timed {said} in {len(times)} of {rounds} rounds: no time, no speedup",
    )  # fmt: skip


def point_decision(
    samples: Dict[str, List[float]], strategies: List[str], controls: List[str], level: float, epsilon: Optional[float]
) -> Decision:
    """The Decision the final samples support; settled_at is their round count where it settled."""
    call = decide(samples, strategies, level, controls, epsilon)
    rounds = len(samples[BASELINE])
    return Decision(call, rounds, rounds if call.settled else None, level, epsilon=epsilon)


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
        n=n,
        params=params,
        timings={},
        speedups={},
        speedup_ci={},
        verdicts={},
        correct=correct,
        best_strategy=None,
        best_speedup=None,
        checks=checks,
        stats={},
        peak_memory_bytes=dict(peak_memory_bytes or {}),
        failures=failures,
    )


def _correctness(checks: Dict[str, Check], failures: Dict[str, Failure]) -> Dict[str, bool]:
    """Strategy -> correct; a strategy that failed to run is not correct (one skipped is neither)."""
    correct = {s: c.correct for s, c in checks.items()}
    correct.update({s: False for s, f in failures.items() if s != "point" and f.kind != "skipped"})
    return correct


def significant_speedup(best: Optional[str], speedups: Dict[str, float], verdicts: Dict[str, str]) -> Optional[float]:
    return speedups[best] if best is not None and verdicts[best] == "faster" else None


def winner_of(best: Optional[str], verdicts: Dict[str, str], decision: Optional[Decision] = None) -> str:
    if decision is not None and decision.kind == "fuse" and decision.call.strategy is not None:
        return decision.call.strategy  # within ε of the margin, or beyond it
    if best is not None and verdicts[best] == "faster":
        return best
    if decision is not None and decision.kind in (MARGINAL, OPEN):  # a Call's kinds are these winners
        return decision.kind
    if best is not None and verdicts[best] == "same":
        return NO_DIFFERENCE
    return BASELINE


def reported_kind(point: PointResult) -> Kind:
    """The decision on fusing (its strategy, its regret) that the intervals a point reports
    support (decisions.kind_of over its correct strategies, by the rule that decided the point):
    what its label must be."""
    cis = point.speedup_ci
    ratios = {s: (point.speedups[s], cis[s][0], cis[s][1]) for s in _fusing(cis, point.correct)}
    epsilon = point.decision.epsilon if point.decision is not None else None
    if not ratios:
        return Kind("loop", None, None if epsilon is None else 0.0)
    return kind_of(ratios, epsilon)


def _fusing(timed: Iterable[str], correct: Dict[str, bool]) -> List[str]:
    """The strategies whose speedups decide on fusing: correct, and not a control."""
    return [s for s in timed if correct.get(s, False) and s not in CONTROLS]


def interval_text(point: PointResult, strategy: str) -> str:
    if strategy not in point.speedup_ci:
        return "not timed"
    lo, hi = point.speedup_ci[strategy]
    return f"{point.speedups[strategy]:.2f}x [{lo:.2f},{hi:.2f}]"


def parameter_groups(points: Sequence[PointResult]) -> Iterator[List[PointResult]]:
    """Points sharing every parameter but N, in N order; skipped points say nothing about crossovers."""
    groups: Dict[str, List[PointResult]] = {}
    for p in points:
        if "point" in p.failures and p.failures["point"].kind == "skipped":
            continue
        groups.setdefault(group_key(p.params), []).append(p)
    for ps in groups.values():
        yield sorted(ps, key=lambda p: p.n)


def result_of(points: List[PointResult], stopped: Optional[str] = None, **run_info: Any) -> BenchmarkResult:
    """An op's result from its points: groups, crossovers and what each point's decision feeds,
    wins, headline, and reliability judged by decisions (results.reliability); `stopped` says
    why its measuring stopped early, the first reason it is not reliable."""
    group_results, analysed = [], {}
    for ps in parameter_groups(points):
        feeds = feeds_of(ps)
        for p, fed in zip(ps, feeds):
            # a point already analysed so is kept as it is (the results file encodes each point
            # object once: ResultsFile)
            if p.decision is not None and p.decision.feeds != fed:
                analysed[id(p)] = dataclasses.replace(p, decision=dataclasses.replace(p.decision, feeds=fed))
        problems, notes = judge(ps, feeds)
        falls_n, fell = falls(ps)
        group_results.append(
            GroupResult(
                params=ps[0].params,
                n_values=[p.n for p in ps],
                crossover_n=group_crossover([(p.n, p.fused_wins) for p in ps]),
                problems=problems,
                fuse_or_capture=fuse_or_capture(ps[-1]),
                marginal_n=[p.n for p in ps if p.winner == MARGINAL],
                notes=[*notes, *fell],
                undecided_n=[p.n for p, fed in zip(ps, feeds) if "crossover" in fed and _undecided(p)],
                falls_n=falls_n,
            )
        )
    points = [analysed.get(id(p), p) for p in points]
    crossovers = [g.crossover_n for g in group_results]
    speedups = [p.best_speedup for p in points if p.best_speedup is not None]
    troubled = [g for g in group_results if g.problems]
    reasons = [f"{params_text(g.params)}: {_problem_digest(g.problems)}" for g in troubled[:_REASONS_SHOWN]]
    if len(troubled) > _REASONS_SHOWN:
        reasons.append(f"and {len(troubled) - _REASONS_SHOWN} more of {len(group_results)} groups")
    reasons = [stopped, *reasons] if stopped else reasons
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


def _undecided(point: PointResult) -> bool:
    """No fuse decision can be drawn from the point: disturbed, unstable or still open."""
    open_ = point.decision is not None and point.decision.call.kind == "open"
    return point.disturbed or point.unstable or open_


def fuse_or_capture(point: PointResult) -> Optional[FuseOrCapture]:
    """The point's best strategy against its fastest correct control, or None without both."""
    controls = [c for c in CONTROLS if c in point.stats and point.correct.get(c, False)]
    best = point.best_strategy
    if not controls or best is None or point.disturbed:
        return None
    control = min(controls, key=lambda c: point.timings[c])
    level = point.decision.level if point.decision is not None else 0.95
    speedup, lo, hi = paired_ratio(point.stats[control].samples_ms, point.stats[best].samples_ms, level)
    samples = {name: point.stats[name].samples_ms for name in (best, control)}
    epsilon = point.decision.epsilon if point.decision is not None else None
    answer = decide_capture(samples, best, [control], level, epsilon)
    return FuseOrCapture(point.n, best, control, speedup, [lo, hi], verdict((lo, hi)), answer)


def _problem_digest(problems: List[str]) -> str:
    """'busy machine at N=1,4; unstable at N=16' from a group's 'N=1: busy machine: ...' lines."""
    where: Dict[str, List[str]] = {}
    for line in problems:
        n, _, text = line.partition(": ")
        where.setdefault(text.split(":")[0], []).append(n[2:])
    return "; ".join(f"{kind} at N={','.join(dict.fromkeys(ns))}" for kind, ns in where.items())


def first_verdict(point: PointResult) -> str:
    """The first pass's verdict at a point, as the unstable-point messages quote it."""
    s = point.best_strategy
    if s is None or s not in point.verdicts:
        return BASELINE
    return f"{s} {interval_text(point, s)}"
