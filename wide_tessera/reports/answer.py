"""A result's answers in words: a point's decision with what a wrong choice can cost, a
group's crossover (with its marginal points, in files from before regret bounds), fuse or
capture, and the legend of the intervals. Every table that states an answer states it with
these."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Tuple

from ..core.job import params_text
from ..core.stats import MIN_EFFECT
from ..results.analysis import reported_kind
from ..results.decisions import ALPHA, MARGIN, ZONE, Call
from ..results.schema import MARGINAL

if TYPE_CHECKING:
    from ..results.schema import BenchmarkResult, GroupResult, PointResult

__all__ = [
    "n_or_never",
    "level_text",
    "percent",
    "regret_words",
    "bound_lines",
    "decision_cell",
    "crossover_known",
    "crossover_range",
    "crossovers_agree",
    "crossover_text",
    "result_n_text",
    "capture_text",
    "interval_legend",
    "level_of_result",
]


def level_text(level: float) -> str:
    """'99.4%': an interval's level as the tables and plots write it."""
    return f"{100 * level:.3g}%"


def percent(fraction: float) -> str:
    """'0.3%', '1.0%', '19%': a regret as the answers write it."""
    return f"{100 * fraction:.1f}%" if fraction < 0.1 else f"{100 * fraction:.0f}%"


def regret_words(call: Call) -> str:
    """A decision with what a wrong choice can cost, as a user acts on it: 'loop; fusing would
    gain at most 0.3% beyond the margin', 'fuse with bmm; if it falls short of the margin, by at
    most 1.0%', 'open: up to 19% at stake'; '' where nothing is at stake (a fuse above the
    margin, a loop below it) or the call has no regret (files from before regret bounds).
    Where the other action was within ε too, it says that this one's worst case is the smaller:
    '...; the smaller worst case (the loop's: 1.0%)'."""
    r = call.regret
    if not r:
        return ""
    other = call.other_regret
    if other is None:
        against = ""
    else:
        action = "the loop's" if call.kind == "fuse" else "fusing's"
        against = f"; the smaller worst case ({action}: {percent(other)})"
    if call.kind == "fuse":
        return f"fuse with {call.strategy}; if it falls short of the margin, by at most {percent(r)}{against}"
    if call.kind == "loop":
        return f"loop; fusing would gain at most {percent(r)} beyond the margin{against}"
    return f"open: up to {percent(r)} at stake"


def bound_lines(result: "BenchmarkResult") -> List[str]:
    """'what a wrong choice can cost: N=8: loop; fusing would gain at most 0.3% beyond the
    margin; ...': the points an answer rests on whose decision costs something if wrong."""
    several = len(result.groups) > 1
    words = [
        f"N={p.n}{f' {params_text(p.params)}' if several else ''}: {regret_words(p.decision.call)}"
        for p in result.points
        if p.decision is not None and p.decision.feeds and not (p.disturbed or p.unstable)
        and regret_words(p.decision.call)
    ]  # fmt: skip
    return ["what a wrong choice can cost: " + "; ".join(words)] if words else []


def n_or_never(n: Optional[int]) -> str:
    """A crossover or threshold N as every table writes it: the number, or 'never'."""
    return "never" if n is None else str(n)


def decision_cell(point: "PointResult", confirmed_mark: bool = True) -> str:
    """'fuse bmm', 'fuse bmm (tie einsum)', 'fuse bmm (may be 1.0% short)', 'loop', 'loop (fusing
    may gain 0.3%)', 'open (19% at stake)', 'UNSTABLE ...', 'DISTURBED', 'marginal' (files from
    before regret bounds): what the point decided (the winner, for files from before decisions)."""
    if "point" in point.failures:
        return "-"
    if point.unstable:
        return f"UNSTABLE (then {point.confirmation.winner})"
    if point.disturbed:
        return "DISTURBED"
    confirmed = " (confirmed)" if confirmed_mark and point.confirmation is not None else ""
    if point.decision is None:
        return point.winner + confirmed
    call = point.decision.call
    if call.kind == "fuse":
        ties = f" (tie {', '.join(call.ties)})" if call.ties else ""
        rivals = f" (or {', '.join(call.rivals)}?)" if call.rivals else ""
        short = f" (may be {percent(call.regret)} short)" if call.regret else ""
        return f"fuse {call.strategy}{short}{ties}{rivals}{confirmed}"
    if call.regret is None or call.kind == MARGINAL:
        return call.kind + confirmed
    if call.kind == "loop":
        return f"loop{f' (fusing may gain {percent(call.regret)})' if call.regret else ''}{confirmed}"
    return f"open ({percent(call.regret)} at stake){confirmed}"


def crossover_known(group: "GroupResult") -> bool:
    """False when the group never crosses only because its largest N was not decided: fusing
    may win there, and 'never' would be a claim nothing measured."""
    return group.crossover_n is not None or group.n_values[-1:] != group.undecided_n[-1:]


def crossover_range(result: "BenchmarkResult", group: "GroupResult") -> Tuple[float, float]:
    """The Ns a group's crossover could be: from the crossover it would have if its marginal points
    fused (the smallest N from which every point fuses or is marginal) to the strict one (inf:
    never). "fuse from N=8; N=4 marginal" is 4 to 8; "never; N=16 marginal" with N=2 to 8 fusing
    is 2 to never. A marginal point gains about the margin, so either side of it is an answer;
    but only where its intervals say so (results.analysis.reported_kind): files from before issue
    48 called points marginal over 0.78x to 1.54x, and a crossover moving across one is no
    agreement. An undecided point is no side either: a run whose crossover rests on one flags it."""
    high = math.inf if group.crossover_n is None else group.crossover_n
    points = [p for p in result.points if p.params == group.params]
    fuses = {p.n for p in points if p.fused_wins or (p.n in group.marginal_n and reported_kind(p)[0] == MARGINAL)}
    low = math.inf
    for n in sorted(group.n_values, reverse=True):
        if n not in fuses:
            break
        low = n
    return min(low, high), high


def crossovers_agree(a: "BenchmarkResult", in_a: "GroupResult", b: "BenchmarkResult", in_b: "GroupResult") -> bool:
    """Whether two runs' crossovers of a group agree: their ranges (`crossover_range`) overlap."""
    (low_a, high_a), (low_b, high_b) = crossover_range(a, in_a), crossover_range(b, in_b)
    return max(low_a, low_b) <= min(high_a, high_b)


def crossover_text(group: "GroupResult") -> str:
    """'fuse from N=8; N=4 marginal', 'never', 'never; N=64 marginal', 'fuse from N=16; N=8
    undecided', 'not known; N=32 undecided', 'fuse from N=32; falls at N=16' (the loop at N=16
    above a fuse: the crossover is read above it, results.analysis.falls)."""
    if not crossover_known(group):
        text = "not known"
    else:
        text = "never" if group.crossover_n is None else f"fuse from N={group.crossover_n}"
    if group.marginal_n:
        text += f"; N={','.join(map(str, group.marginal_n))} marginal"
    if group.falls_n:
        text += f"; falls at N={','.join(map(str, group.falls_n))}"
    if group.undecided_n:
        text += f"; N={','.join(map(str, group.undecided_n))} undecided"
    return text


def result_n_text(result: "BenchmarkResult", n: Optional[int]) -> str:
    """A result's crossover_n or recommended_threshold: the number, 'never', or 'not known'
    where it is None and a group whose largest N decided nothing may yet cross."""
    if n is None and not all(crossover_known(g) for g in result.groups):
        return "not known"
    return n_or_never(n)


def capture_text(group: "GroupResult") -> str:
    """At a group's largest N: 'fuse (bmm 2.02x [1.97,2.22] the speed of loop_compiled)', or ''."""
    f = group.fuse_or_capture
    if f is None:
        return ""
    answer = f.answer or {"faster": "fuse", "slower": "capture", "same": "either"}[f.verdict]
    words = {"fuse": "fuse", "capture": f"{f.control}, no fusion", "either": "either", "open": "open"}[answer]
    return f"{words} ({f.strategy} {f.speedup:.2f}x [{f.ci[0]:.2f},{f.ci[1]:.2f}] the speed of {f.control})"


def level_of_result(result: "BenchmarkResult") -> Optional[float]:
    """The intervals' level (None for a file from before decisions: 95%)."""
    levels = [p.decision.level for p in result.points if p.decision is not None]
    return levels[0] if levels else None


def interval_legend(result: "BenchmarkResult") -> List[str]:
    """What the intervals and the decisions mean, in the words of results.decisions: by the rule
    the result was decided by (its regret bound, or the marginal zone before it)."""
    level = level_of_result(result)
    margin, (low, high) = MARGIN, ZONE
    if level is None or abs(level - 0.95) < 1e-9:
        precise = (
            ": --precise, sampled until every median was known within --target-ci" if result.settings.precise else ""
        )
        ci = f"speedup [95% CI]{precise}."
    else:
        ci = (
            f"speedup [{level_text(level)} CI]: the median of the paired rounds' ratios; sampling stopped as soon "
            "as the decision was settled, and each interval holds at 95% over every look it could have stopped at."
        )
    epsilon = result.settings.regret
    if epsilon is not None:
        return [
            ci,
            f"fuse S: if S falls short of the {100 * MIN_EFFECT:.0f}% margin, by at most the % shown (none shown: "
            f"its whole interval is above {margin:.2f}), and no strategy known faster than S by more than "
            f"{high:.3f}x; loop: fusing would gain at most the % shown beyond the margin (none shown: every "
            f"interval is below {margin:.2f}); open: undecided at the budget, or over both passes, with the % "
            f"at stake either way. A decision is settled once its worst case is at most {percent(epsilon)} "
            f"(--regret). A fuse bound holds at {level_text(1 - ALPHA / 2)}; the loop's is a maximum over the k "
            f"strategies compared and holds at 1 - k x {level_text(ALPHA / 2)}.",
        ]
    return [
        ci,
        f"fuse: a strategy's whole interval above {margin:.2f} (and the winner known faster than the rest, or tied); "
        f"loop: every interval below {margin:.2f}; marginal: within {low:.3f}..{high:.3f}, fusing gains about "
        f"{100 * MIN_EFFECT:.0f}%, either choice costs little; open: undecided at the budget, or the passes' "
        f"intervals together lie across {margin:.2f}.",
    ]
