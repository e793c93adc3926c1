"""The decisions a point's measurement is for, and when it has made them.

A point answers: fuse here, and with which strategy? At a group's largest N it also answers:
fuse, or just make the loop cheaper (capture it in a CUDA graph, compile it)? Each answer
rests on speedups with confidence intervals, and sampling stops as soon as every answer is
settled, instead of when every median is known to 2%:

* a strategy **beats the margin** when its whole interval lies above 1 + MIN_EFFECT, and is
  **known not to** when the whole interval lies below it;
* each action has a worst case over the intervals (its **regret**, what a wrong choice can
  cost beyond the margin): fusing with S costs MARGIN/lo - 1 if S's truth is its interval's
  bottom; the loop costs max(hi)/MARGIN - 1 if the fastest strategy's truth is its top;
* the point is **fuse** (strategy S) or **loop**, whichever worst case is smaller (a tie: the
  loop, which costs nothing to keep; where both are within ε the call says so, `other_regret`),
  as soon as it is at most ε (RunSettings.regret, 2%): ε-best-arm identification (Even-Dar,
  Mannor and Mansour 2002), which contains the rule of a margin alone, whose fuse (lo above
  the margin) and loop (every hi below it) have no regret at all. Fuse also needs the winner's identity:
  every other strategy known slower than S or tied with it, not known slower but known not
  faster than S by more than the margin and its own zone, ZONE (an indifference zone, as in
  Bechhofer's selection of the best: choosing S costs at most that). Else the point is
  **open**, with the smaller worst case at stake. Given time every point settles: both
  intervals shrink until one worst case is within ε. Of the strategies whose worst case is
  within ε and below the loop's, the point fuses with the fastest. Fuse or capture follows
  the same rule with the fastest control in the baseline's place: 'fuse', 'capture' (fusing
  would gain at most ε beyond the margin over the captured loop) or 'open'.
* Files from before this rule (a Decision without `epsilon`) were decided by the margin and a
  **marginal** zone around it, MARGINAL_ZONE either side: 'marginal' (every strategy that
  might beat the margin known to lie within the zone) and, for fuse or capture, 'either'.
  Their decisions are read, and re-derived, by that rule (`_kind_before_regret`).

Repeated looks. The rule looks at the data at geometric round counts (10, 20, 40, ... up to
the timer's max_samples) and once more when the budget is spent, and could stop at any of
them. Each look's intervals are at level 1 - ALPHA / looks (Bonferroni), so the chance that
any interval of a speedup misses its true value at any look, the one the run stopped at
included, is at most ALPHA: optional stopping does not erode the 95%. The intervals a result
reports are those of the look it stopped at, at that level (`level`). scripts/coverage.py
measures their coverage under this rule. The loop's worst case is a maximum over the k
strategies a point compares, and it is wrong only when one of their tops misses, a one-sided
miss of at most ALPHA/2 each: it holds at 1 - k * ALPHA/2 (95% with two strategies), not at
1 - ALPHA/2; a fuse bound rests on one interval's bottom and holds at 1 - ALPHA/2.
scripts/regret.py measures how often a decision's regret exceeds ε.

The speedup is the median of the per-round ratios (core.stats.paired_ratio), its interval
from order statistics: distribution-free, and valid at ten rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from dataclasses_json import dataclass_json

from ..core.roles import BASELINE
from ..core.stats import MARGINAL_ZONE, MIN_EFFECT, REGRET, paired_ratio
from ..measurement.settings import RunSettings
from ..measurement.timing import Look, StopRule, TimingConfig

__all__ = [
    "ALPHA",
    "MARGIN",
    "ZONE",
    "fuse_regret",
    "loop_regret",
    "Call",
    "Decision",
    "UNUSABLE",
    "unusable",
    "looks",
    "decision_level",
    "level_of",
    "stop_rule",
    "classify",
    "decide",
    "Kind",
    "kind_of",
    "decide_capture",
    "compatible",
    "same_winner",
    "KINDS",
    "CAPTURE_KINDS",
]

# The chance, over all looks, that a reported interval misses its true value.
ALPHA = 0.05
MARGIN = 1 + MIN_EFFECT
# The zone around the margin, 1.029 to 1.071: the winner's indifference zone (a strategy not
# faster than the winner by more than 1.071x ties with it), and the marginal zone of the rule
# before regret bounds.
ZONE = (MARGIN / (1 + MARGINAL_ZONE), MARGIN * (1 + MARGINAL_ZONE))

# 'marginal' and 'either' only in files from before regret bounds
KINDS = ("fuse", "marginal", "loop", "open")
CAPTURE_KINDS = ("fuse", "capture", "either", "open")


def fuse_regret(lo: float) -> float:
    """What fusing costs beyond the margin if the speedup is its interval's bottom `lo`."""
    return max(0.0, MARGIN / lo - 1)


def loop_regret(his: Sequence[float]) -> float:
    """What the loop costs beyond the margin if the fastest strategy's speedup is its interval's top."""
    return max(0.0, max(his) / MARGIN - 1)


# A Failure's error_type for a function whose rounds hold no positive finite time (`unusable`).
UNUSABLE = "UnusableTiming"


def unusable(samples: Samples) -> Dict[str, List[float]]:
    """Function -> the times among its samples that are no positive finite number of ms (NaN,
    an infinity, 0 or less), for those that have any. No ratio or regret is drawn from such a
    round: a NaN compares false with every bound, so the rule would decide past it; an infinity
    or a 0 makes a ratio 0 and a regret divide by zero."""
    return {f: bad for f, ms in samples.items() if (bad := [m for m in ms if not 0 < m < math.inf])}


def looks(config: TimingConfig) -> List[int]:
    """The round counts at which the decision rule looks: min_samples, doubling, up to max_samples."""
    counts = []
    n = config.min_samples
    while n <= config.max_samples:
        counts.append(n)
        n *= 2
    return counts


def decision_level(config: TimingConfig) -> float:
    """The confidence of each look's intervals: 1 - ALPHA / (the scheduled looks and the last one
    when the budget runs out). 0.99375 with the default 10 to 1000 rounds (eight looks)."""
    return 1 - ALPHA / (len(looks(config)) + 1)


def level_of(settings: RunSettings) -> float:
    """The level of a run's intervals: decision_level, or 95% for --precise, which stops on the
    medians' precision, not on the speedups (no look at a speedup can stop it)."""
    assert settings.timing is not None  # RunSettings.__post_init__ fills it
    return 1 - ALPHA if settings.precise else decision_level(settings.timing)


def stop_rule(strategies: Sequence[str], controls: Sequence[str], settings: RunSettings) -> Optional[StopRule]:
    """The timer's stop rule for a point whose correct `strategies` (and `controls`) are timed:
    stop at a scheduled look once its Call is settled; None (the precision rule) for --precise."""
    if settings.precise:
        return None
    assert settings.timing is not None  # RunSettings.__post_init__ fills it
    scheduled, level = set(looks(settings.timing)), level_of(settings)

    def stop(samples: Dict[str, List[float]]) -> Look:
        if len(samples[BASELINE]) not in scheduled:
            return Look(False)
        # no more rounds make a time that is not one usable: the point names it (results.analysis)
        bad = unusable(samples)
        if BASELINE in bad:
            return Look(True)
        usable = {f: ms for f, ms in samples.items() if f not in bad}
        call = decide(usable, strategies, level, controls, settings.regret)
        return Look(call.settled, frozenset([*settled_parts(usable, call, strategies, controls, level), *bad]))

    return stop


def settled_parts(
    samples: Samples, call: Call, strategies: Sequence[str], controls: Sequence[str], level: float
) -> List[str]:
    """The functions whose part in the point's decisions is settled at this look, so that later
    rounds may leave them out: a strategy known not to beat the margin, or known slower than
    the winner; a control, once fuse-or-capture is answered. Their intervals stay those of the
    look they left at, whose level covers it."""
    done = []
    for s in strategies:
        if s == call.strategy or s not in samples:
            continue
        _, lo, hi = paired_ratio(samples[BASELINE], samples[s], level)
        slower = call.kind == "fuse" and s not in call.ties and s not in call.rivals
        if hi < MARGIN or slower:
            done.append(s)
    if call.capture not in (None, "open"):
        done += [c for c in controls if c in samples]
    return done


@dataclass_json
@dataclass(frozen=True)
class Call:
    """What a point decided about fusing, at the look it stopped at.

    kind: 'fuse' (with `strategy`), 'loop', or 'open' (undecided when the budget ran out, or
    over a point's passes taken together: results.analysis; `strategy` the provisional best);
    'marginal' in files from before regret bounds. regret: the kind's worst case beyond the
    margin (fuse: how far `strategy` may fall short of it; loop: how much fusing may gain beyond
    it; open: the smaller of the two, what is at stake); None in files from before it.
    ties: strategies not known slower than the winner, but known not faster by more than the
    margin. rivals: strategies that may be faster
    than the winner by more than the margin (the winner's identity is open). capture: at a
    group's largest N, the best strategy against the fastest control: 'fuse', 'capture',
    'either' or 'open' (None where no control ran). other_regret: where the action not taken
    (fuse or loop) was within ε too, its worst case: the call took the smaller (`kind_of`).
    """

    kind: str
    strategy: Optional[str] = None
    ties: List[str] = field(default_factory=list)
    rivals: List[str] = field(default_factory=list)
    capture: Optional[str] = None
    regret: Optional[float] = None
    other_regret: Optional[float] = None

    @property
    def settled(self) -> bool:
        return self.kind != "open" and not self.rivals and self.capture != "open"


@dataclass_json
@dataclass(frozen=True)
class Decision:
    """A point's decision and how it was reached: the Call; the rounds taken; the round count at
    which it settled (None: it never did); the intervals' level; the decisions of its group
    that it feeds ('crossover', 'winner', 'fuse_or_capture'; set when the result is analysed);
    the ε it was settled to (RunSettings.regret; None: decided by the rule before regret
    bounds, with its marginal zone)."""

    call: Call
    rounds: int
    settled_at: Optional[int]
    level: float
    feeds: List[str] = field(default_factory=list)
    epsilon: Optional[float] = None

    @property
    def kind(self) -> str:
        return self.call.kind


def classify(lo: float, hi: float) -> str:
    """Where a speedup interval lies against the margin, by the rule before regret bounds:
    'beats' (wholly above it), 'marginal' (wholly within the zone around it), 'below' (wholly
    below it), else 'open'."""
    if lo > MARGIN:
        return "beats"
    if ZONE[0] <= lo and hi <= ZONE[1]:
        return "marginal"
    if hi < MARGIN:
        return "below"
    return "open"


Samples = Mapping[str, Sequence[float]]


def decide(
    samples: Samples,
    strategies: Sequence[str],
    level: float,
    controls: Sequence[str] = (),
    epsilon: Optional[float] = REGRET,
) -> Call:
    """The Call the samples (ms per call, paired by round; 'baseline' among them) support at
    `level` and regret `epsilon` (None: the rule before regret bounds), over the correct
    `strategies` that were timed; with `controls`, the fuse-or-capture answer too."""
    timed = [s for s in strategies if s in samples]
    if not timed:
        return Call("loop", regret=None if epsilon is None else 0.0)
    ratios = {s: paired_ratio(samples[BASELINE], samples[s], level) for s in timed}
    kind, strategy, regret, other = kind_of(ratios, epsilon)
    assert strategy is not None  # kind_of names one of the strategies it was given
    ties: List[str] = []
    rivals: List[str] = []
    if kind == "fuse":
        # known slower than the winner outright: its whole interval below the winner's
        below_winner = [s for s in timed if ratios[s][2] < ratios[strategy][1]]
        others = [s for s in timed if s != strategy and s not in below_winner]
        ties, rivals = _against(samples, strategy, others, level)
    # where fusing loses, capturing the loop is all there is to weigh
    capture = decide_capture(samples, strategy, controls, level, epsilon) if controls and kind != "loop" else None
    return Call(kind, strategy, ties, rivals, capture, regret, other)


class Kind(NamedTuple):
    """`kind_of`'s answer: the kind, its strategy, its regret (None by the rule before regret
    bounds), and `other`: where the action not taken was within ε too, its worst case, larger
    than the chosen one's or equal to it (a tie goes to the loop)."""

    kind: str
    strategy: Optional[str]
    regret: Optional[float]
    other: Optional[float] = None


def kind_of(ratios: Mapping[str, Tuple[float, float, float]], epsilon: Optional[float]) -> Kind:
    """The decision on fusing that speedups (strategy -> (median, low, high); at least one)
    support at regret `epsilon`: of the actions whose worst case is within ε, the one whose
    worst case is smaller, a tie going to the loop (it costs nothing to keep): 'fuse' with the
    fastest strategy whose worst case is within ε and below the loop's, else 'loop' with the
    fastest; else 'open' with the fastest, the smaller worst case at stake. Fusing with the
    fastest strategy within ε whatever the loop's worst case chose, between two strategies
    within ε and a loop within 1%, a fuse that may fall 1.4% short over one 0.1% short.
    `decide` applies it to a pass's intervals, results.analysis to a point's intervals over
    several passes: one rule, so that no label says more than the intervals it is shown with.
    epsilon None: the rule before regret bounds (`_kind_before_regret`), no regret."""
    if epsilon is None:
        return Kind(*_kind_before_regret(ratios), None)
    fusing = {s: fuse_regret(lo) for s, (_, lo, _) in ratios.items()}
    looping = loop_regret([hi for _, _, hi in ratios.values()])
    best = min(fusing.values())
    better = [s for s in ratios if fusing[s] <= epsilon and fusing[s] < looping]
    if better:
        s = max(better, key=lambda s: ratios[s][0])
        return Kind("fuse", s, fusing[s], looping if looping <= epsilon else None)
    fastest = max(ratios, key=lambda s: ratios[s][0])
    if looping <= epsilon:
        return Kind("loop", fastest, looping, best if best <= epsilon else None)
    return Kind("open", fastest, min(best, looping))


def _kind_before_regret(ratios: Mapping[str, Tuple[float, float, float]]) -> Tuple[str, str]:
    """The rule of files from before regret bounds: 'fuse' with the fastest that beats the
    margin; 'loop' (every one known not to) with the fastest; 'marginal' (every one known not
    to, or within the zone) with the fastest within the zone; else 'open' with the fastest."""
    places = {s: classify(lo, hi) for s, (_, lo, hi) in ratios.items()}

    def fastest(kinds: Sequence[str]) -> str:
        return max((s for s in ratios if places[s] in kinds), key=lambda s: ratios[s][0])

    if "beats" in places.values():
        return "fuse", fastest(["beats"])
    if all(p == "below" for p in places.values()):
        return "loop", fastest(["below"])
    if all(p in ("below", "marginal") for p in places.values()):
        return "marginal", fastest(["marginal"])
    return "open", fastest(["below", "marginal", "open"])


def _against(samples: Samples, winner: str, others: Sequence[str], level: float) -> Tuple[List[str], List[str]]:
    """Of `others`: those that tie with `winner` (not known slower, but known not faster than it
    by more than the margin and its zone: choosing the winner costs at most that, Bechhofer's
    indifference zone), and its rivals (not known slower, and possibly faster by more).

    The zone, as for marginal decisions: with the margin alone, mlp's einsum and bmm, one
    kernel on a CPU, stayed 'not yet told apart' at the budget in a quiet quick run, their
    ratio's interval reaching 0.94 at 99.4%; two strategies that are one computation must
    close as a tie."""
    ties: List[str] = []
    rivals: List[str] = []
    for s in others:
        _, lo, _ = paired_ratio(samples[s], samples[winner], level)  # > 1: the winner is faster
        if lo > 1:  # known slower
            continue
        (ties if lo >= 1 / ZONE[1] else rivals).append(s)
    return ties, rivals


def decide_capture(
    samples: Samples, strategy: str, controls: Sequence[str], level: float, epsilon: Optional[float] = REGRET
) -> str:
    """Fuse with `strategy`, or capture the loop with the fastest control? The fuse decision's
    rule (`kind_of`) with the control in the baseline's place: 'fuse', 'capture' (capturing the
    loop is enough: fusing would gain at most ε beyond the margin over it) or 'open'; 'either'
    where no control or strategy was timed, and by the rule before regret bounds where the
    speedup is known to lie in the zone around the margin."""
    timed = [c for c in controls if c in samples]
    if not timed or strategy not in samples:
        return "either"
    control = min(timed, key=lambda c: _median(samples[c]))
    ratio = paired_ratio(samples[control], samples[strategy], level)
    kind = kind_of({strategy: ratio}, epsilon)[0]
    return {"fuse": "fuse", "loop": "capture", "marginal": "either", "open": "open"}[kind]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def compatible(first: Call, second: Call) -> bool:
    """Whether two passes agree at a point: a win against a loop is a flip, and so are two wins
    that name different winners (`same_winner`): confirming the first would say what the second
    denies. A marginal or open pass contradicts nothing, though over both passes the point may
    be undecided (results.passes.disputed)."""
    kinds = {first.kind, second.kind}
    return bool(kinds & {"open", "marginal"}) or (len(kinds) == 1 and same_winner(first, second))


def same_winner(first: Call, second: Call) -> bool:
    """Whether two passes that both fuse name one winner, or winners one of them did not tell
    apart from its own (tied with it, or a rival not yet told apart): a pass denies another's
    winner only where it knows it slower."""
    if first.kind != "fuse" or second.kind != "fuse":
        return True
    return (
        first.strategy == second.strategy
        or second.strategy in (*first.ties, *first.rivals)
        or first.strategy in (*second.ties, *second.rivals)
    )
