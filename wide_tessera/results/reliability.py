"""Is a group's answer reliable? Judged by decisions: only what could flip one is a reason.

A group answers three things: its crossover (from which N fusing wins at every larger N),
the winner at its largest N, and there whether to fuse or just make the loop cheaper. A
point *feeds* the crossover when flipping its own decision alone would move it: the crossover
point, the one below it and every point above (or, in a group that never crosses, the largest
N); the largest N feeds the other two. A decision of the group could flip, and the result is
UNRELIABLE, only when a point it rests on

* was disturbed and never measured clean (a clean measurement outranks a disturbed one of
  the same point, passes.confirmed);
* was measured twice and the two contradict each other (unstable);
* timed a round in no positive finite time (NaN, an infinity: decisions.unusable), so that
  the point was decided without that function, or (the baseline) not at all;
* is still open when the budget is spent: neither fusing nor the loop known to cost at most
  ε beyond the margin (its winner's identity or fuse-or-capture included), or over its
  passes (one settled, and over both builds' intervals together neither is within ε: a
  disagreement between builds beyond ε; results.passes.disputed, after the third pass that
  buys).

Everything else is recorded as a note, never a reason: a busy machine that disturbed no
deciding round, a disturbed point that decides nothing, intervals near the margin of a
control or of a strategy that does not decide, or near the lower margin when the decision
is clear.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .decisions import UNUSABLE, Call, same_winner
from .schema import PointResult

__all__ = ["feeds_of", "judge"]


def feeds_of(group: Sequence[PointResult]) -> List[List[str]]:
    """For each point of a group (in N order): the group's decisions that rest on it."""
    wins = [p.fused_wins for p in group]
    first = len(wins)
    while first > 0 and wins[first - 1]:
        first -= 1
    # crossover at index `first` (none when it is len(wins)): it, the point below and all above feed it
    low = max(first - 1, 0) if first < len(wins) else len(wins) - 1
    feeds: List[List[str]] = [["crossover"] if i >= low else [] for i in range(len(group))]
    if feeds:
        feeds[-1] += ["winner", "fuse_or_capture"]
    return feeds


def judge(group: Sequence[PointResult], feeds: Sequence[List[str]]) -> Tuple[List[str], List[str]]:
    """(problems, notes) of a group: problems are what could flip one of its decisions, each
    'N=8: kind: detail'; notes everything else worth knowing."""
    problems: List[str] = []
    notes: List[str] = []
    for p, fed in zip(group, feeds):
        where = f"N={p.n}"
        health = [h for h in (p.health, p.confirmation.health if p.confirmation else None) if h is not None]
        if p.disturbed:
            why = next(h.problems[0] for h in health if h.problems).removeprefix("disturbed: ")
            again = [f"{h.disturbed_rounds} of {h.rounds + h.disturbed_rounds}" for h in health[1:] if not h.cleaned]
            then = f"; in the confirmation {again[0]}" if again else ""
            (problems if fed else notes).append(f"{where}: disturbed: {why}{then} (never measured clean)")
        notes += [f"{where}: {why}" for h in health for why in h.problems if not why.startswith("disturbed")]
        unusable = [f.message for f in p.failures.values() if f.error_type == UNUSABLE]
        (problems if fed else notes).extend(f"{where}: unusable timing: {why}" for why in unusable)
        if p.unstable:
            problems.append(f"{where}: unstable: the passes contradict each other ({_calls(p)})")
        decision = p.decision
        if decision is None or p.disturbed or p.unstable:
            continue
        call = decision.call
        if call.kind == "open" and "crossover" in fed:
            problems.append(f"{where}: open: {_open_why(call, decision.epsilon)}")
        elif call.kind == "open":
            notes.append(f"{where}: open, but no decision rests on it")
        if "winner" in fed and _winners_differ(p):
            problems.append(f"{where}: unstable winner: the passes name different winners ({_calls(p)})")
        if call.rivals and "winner" in fed:
            problems.append(f"{where}: open: {call.strategy} is not yet told apart from {', '.join(call.rivals)}")
        if call.capture == "open" and "fuse_or_capture" in fed:
            problems.append(f"{where}: open: fuse or capture is not yet decided")
    return problems, list(dict.fromkeys(notes))


def _open_why(call: Call, epsilon: Optional[float]) -> str:
    """Why an open point decides nothing: what is at stake against what was asked (ε)."""
    best = call.strategy or "no strategy"
    if call.regret is None or epsilon is None:  # the rule before regret bounds
        return f"{best} neither beats the margin nor is known not to"
    return (
        f"up to {100 * call.regret:.3g}% at stake ({best}: neither fusing nor the loop "
        f"is known to cost at most {100 * epsilon:.3g}%)"
    )


def _winners_differ(point: PointResult) -> bool:
    """Both passes clean and fusing, with winners they did not find tied: in points stored before
    such passes counted as contradicting each other (decisions.compatible; a --resume or a
    shard merge reads them), which are not unstable."""
    c = point.confirmation
    if point.decision is None or c is None or c.decision is None or c.replaced:
        return False
    if c.health is not None and not c.health.cleaned:
        return False
    return not same_winner(point.decision.call, c.decision.call)


def _calls(point: PointResult) -> str:
    first = point.decision.call if point.decision else None
    second = point.confirmation.decision.call if point.confirmation and point.confirmation.decision else None
    return " then ".join(f"{c.kind}{f' {c.strategy}' if c.kind == 'fuse' else ''}" for c in (first, second) if c)
