"""A point's passes: the confirmation pass measures the points a group's answers turn on again,
on models and inputs built from seeds of their own, and a point's passes are taken together here.

Where the two passes disagree on the winner's class (a strategy, no difference, the baseline),
the point is 'unstable'. Where both are clean, each interval spans both passes' intervals, and the
verdicts and the decision follow it by the rule of one pass (`_across_passes`). Passes that
contradict each other, or where one cleared the margin and the span leaves the point open, get a
third pass (`disputed`, `settled_by_third`). A results file holds a confirmed point's two passes
(`stored_passes`), so that `--resume` can give it its third.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from ..measurement.timing import PairedTimings
from .analysis import (
    group_crossover,
    interval_text,
    measured_point,
    parameter_groups,
    pick_best,
    reported_kind,
    significant_speedup,
    verdict,
    winner_of,
)
from .decisions import Call, compatible, same_winner
from .schema import FAILED, OPEN, UNSTABLE, Confirmation, PointResult

__all__ = [
    "confirmed",
    "disputed",
    "stored_passes",
    "own_pass",
    "recorded_pass",
    "settled_by_third",
    "deciding",
    "points_to_confirm",
]


def _rank(point: PointResult) -> int:
    """How far a measurement of a point can be trusted: clean and settled, clean and still open,
    disturbed (or failed). A clean measurement outranks a disturbed one of the same point."""
    if not point.timings or point.disturbed:
        return 0
    return 1 if point.decision is not None and point.decision.kind == "open" else 2


def _record(point: PointResult, agrees: bool, replaced: bool = False) -> Confirmation:
    winner = point.winner if point.timings else FAILED
    return Confirmation(
        point.timings, point.speedups, point.speedup_ci, point.verdicts, winner, agrees, point.health,
        point.decision, replaced,
    )  # fmt: skip


def confirmed(first: PointResult, second: PointResult) -> PointResult:
    """The point as its two passes measured it. The better measurement (_rank) is the point's,
    the other its record; the point is 'unstable' only where two clean, settled measurements
    contradict each other's decision (a win against a loop: decisions.compatible)."""
    if _rank(second) > _rank(first):
        primary, other, replaced = second, first, True
    else:
        primary, other, replaced = first, second, False
    contradicts = (
        _rank(other) == 2 == _rank(primary)
        and primary.decision is not None
        and other.decision is not None
        and not compatible(primary.decision.call, other.decision.call)
    )
    confirmation = _record(other, not contradicts, replaced)
    point = _with_facts(dataclasses.replace(primary, confirmation=confirmation), first)
    if contradicts:
        return dataclasses.replace(point, winner=UNSTABLE, best_speedup=None)
    if _rank(primary) >= 1 and _rank(other) >= 1:  # both clean: each interval can speak for its build
        return _across_passes(point, other)
    return point


def _across_passes(point: PointResult, other: PointResult) -> PointResult:
    """`point` with each strategy's interval widened to span both passes' intervals, and the
    verdicts, the decision and the winner those intervals support (`reported_kind`).

    The two passes build models, inputs and allocations from seeds of their own, as two runs
    would. Their 99.4% intervals were disjoint for 6 and 12% of the strategies of two quiet quick
    runs (scripts/pass_agreement.py, 2026-11-25), where sampling noise alone allows well under 1%:
    something that changes from one build to the next (an allocation's alignment, one draw of
    routing) moves a speedup by more than a pass's interval says, so one pass's interval does not
    cover the next run. The span of both does, as far as two builds can show. The point is decided
    by the rule of one pass over the spans: it fuses only where a strategy beats the margin over
    both builds, and it is marginal only where the span lies within the zone. A win one build
    clears the margin with and the other does not is open (a third pass may settle it:
    `disputed`), not marginal: embedding at N=8 spanned 1.21x [0.78, 1.54] in a quick run, and
    'fusing gains about 5%' would have been a claim no pass made (issue 48)."""
    cis = {
        s: [min(lo, other.speedup_ci[s][0]), max(hi, other.speedup_ci[s][1])] if s in other.speedup_ci else [lo, hi]
        for s, (lo, hi) in point.speedup_ci.items()
    }
    verdicts = {s: verdict(ci) for s, ci in cis.items()}
    best = pick_best(point.speedups, verdicts, point.correct)
    widened = dataclasses.replace(
        point,
        speedup_ci=cis,
        verdicts=verdicts,
        best_strategy=best,
        best_speedup=significant_speedup(best, point.speedups, verdicts),
    )
    decision = point.decision
    if decision is None:
        return widened
    kind, strategy, regret, against = reported_kind(widened)
    call = decision.call
    if (kind, strategy) != (call.kind, call.strategy):  # ties and rivals were the pass's, for its winner
        call = Call(kind, strategy, capture=call.capture, regret=regret, other_regret=against)
    else:  # the regret over both passes' intervals
        call = dataclasses.replace(call, regret=regret, other_regret=against)
    flags, was = widened.flags, decision.call.strategy
    if kind != decision.kind and was is not None:
        then = other.decision.kind if other.decision else "-"
        flags = [
            *flags,
            f"{kind} over both passes: {was} {interval_text(point, was)} in one pass ({decision.kind}), "
            f"{interval_text(other, was)} in the other ({then})",
        ]
    decided = dataclasses.replace(decision, call=call)
    return dataclasses.replace(widened, decision=decided, flags=flags, winner=winner_of(best, verdicts, decided))


def disputed(first: PointResult, second: PointResult) -> bool:
    """Whether a point's two passes call for a third: they contradict each other (unstable), or
    one of them cleared the margin, above it or below it (fuse, loop), and over both the point
    is open. One pass's clear answer against another's doubt is what a third can settle; two
    passes that never settled say the budget is too short, which a third would say again."""
    passes = (first, second)
    point = confirmed(*passes)
    cleared = any(_rank(p) == 2 and p.decision is not None and p.decision.kind in ("fuse", "loop") for p in passes)
    return point.unstable or (cleared and point.winner == OPEN)


def _with_facts(point: PointResult, source: PointResult) -> PointResult:
    """`point` with what only the first pass measures (launches, work, energy, first call,
    memory) taken from `source` where `point` lacks it."""
    kept = {
        k: getattr(source, k)
        for k in ("launches", "work", "energy", "first_call_s", "peak_memory_bytes")
        if not getattr(point, k)
    }
    return dataclasses.replace(point, **kept)


# How a point a third pass settled begins its note: it holds that pass and its partner, not the first two.
_THIRD_PASS_NOTE = "the first two passes disagreed"


def stored_passes(point: PointResult) -> Optional[Tuple[PointResult, PointResult]]:
    """A confirmed point's two passes as a results file holds them, in the order the runner
    measured them: its own rebuilt from its samples (`own_pass`), the other from its record
    (`recorded_pass`); None where the point was not confirmed, or a third pass settled it.
    (`--resume` gives a point confirmed before the interruption its third pass from them.)"""
    c = point.confirmation
    if c is None or any(f.startswith(_THIRD_PASS_NOTE) for f in point.flags):
        return None
    own = own_pass(point, point.decision.epsilon if point.decision is not None else None)
    if own is None:
        return None
    other = recorded_pass(own, c)
    return (other, own) if c.replaced else (own, other)


def own_pass(point: PointResult, epsilon: Optional[float]) -> Optional[PointResult]:
    """The point's own measurement rebuilt from the samples a results file holds, as the runner
    built it (measured_point), decided at regret `epsilon` (None: the rule before regret
    bounds); None where it holds no samples or no decision."""
    if not point.timings or point.decision is None or point.health is None:
        return None
    timings = PairedTimings(point.stats, point.health)
    return measured_point(point.n, point.params, timings, point.checks, point.decision.level,
                          point.peak_memory_bytes, point.failures, point.first_call_s, epsilon)  # fmt: skip


def recorded_pass(own: PointResult, c: Confirmation) -> PointResult:
    """The other measurement of a point whose own pass is `own`, from its record `c` (which
    holds no samples)."""
    best = pick_best(c.speedups, c.verdicts, own.correct)
    return dataclasses.replace(
        own, timings=c.timings, speedups=c.speedups, speedup_ci=c.speedup_ci, verdicts=c.verdicts,
        winner=c.winner, health=c.health, decision=c.decision, best_strategy=best, stats={}, flags=[],
    )  # fmt: skip


def settled_by_third(first: PointResult, second: PointResult, third: PointResult) -> PointResult:
    """The point whose first two passes left it `disputed`, decided by a third measurement on
    fresh models and inputs: the third and the pass that agrees with it (the same decision and
    winner), else the pass it contradicts, else the first, taken together as `confirmed` takes
    two passes. So a third pass that sides with one of two contradicting passes decides, one
    that contradicts a pass leaves the point unstable, and one whose interval together with the
    other's still lies across the margin leaves it open. A third pass that is disturbed or still
    open decides nothing: the point is what the first two made it."""
    said = " then ".join(p.decision.kind if p.decision else "nothing" for p in (first, second))
    if _rank(third) < 2:  # (noted, so that a --resume does not take a third pass again: stored_passes)
        point = confirmed(first, second)
        note = f"{_THIRD_PASS_NOTE} ({said}); a third on fresh models settled nothing (disturbed or open)"
        return dataclasses.replace(point, flags=[*point.flags, note])
    assert third.decision is not None  # rank 2: settled
    call = third.decision.call
    calls = [(p, p.decision.call) for p in (first, second) if p.decision is not None]
    agreeing = [p for p, c in calls if c.kind == call.kind and same_winner(c, call)]
    contradicted = [p for p, c in calls if not compatible(c, call)]
    partner = (agreeing + contradicted + [first])[0]
    point = _with_facts(confirmed(third, partner), first)
    note = f"{_THIRD_PASS_NOTE} ({said}); a third on fresh models decided {call.kind}"
    return dataclasses.replace(point, flags=[*point.flags, note])


def deciding(group: Sequence[PointResult]) -> List[PointResult]:
    """The points a group's crossover turns on, which the confirmation pass measures again: the
    crossover point and the one below it, or (never crossing) the largest N. The points above a
    crossover feed it too, but a second pass there buys little: their intervals already hold at
    95% over every look, and the largest N is the slowest point of the group to measure."""
    cross = group_crossover([(p.n, p.fused_wins) for p in group])
    if cross is None:
        return list(group[-1:])
    i = [p.n for p in group].index(cross)
    return list(group[max(0, i - 1) : i + 1])


def points_to_confirm(points: Sequence[PointResult], mode: str) -> List[PointResult]:
    """The measured, not yet confirmed points the confirmation pass takes again under `mode`:
    'all', or ('deciding') those a group's answers turn on (`deciding`)."""
    if mode == "none":
        return []
    measured = [p for p in points if p.timings and p.confirmation is None]
    if mode == "all":
        return measured
    chosen = {id(p) for g in parameter_groups(points) for p in deciding(g)}
    return [p for p in measured if id(p) in chosen]
