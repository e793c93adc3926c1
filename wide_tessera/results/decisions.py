"""The decisions a point's measurement is for, and when it has made them.

A point answers: fuse here, and with which strategy? At a group's largest N it also answers:
fuse, or just make the loop cheaper (capture it in a CUDA graph, compile it)? Each answer
rests on speedups with confidence intervals, and sampling stops as soon as every answer is
settled, instead of when every median is known to 2%:

* a strategy **beats the margin** when its whole interval lies above 1 + MIN_EFFECT, and is
  **known not to** when the whole interval lies below it;
* the point is **fuse** (strategy S) when a strategy beats the margin and, for the winner's
  identity, every other strategy is known slower than S or ties with it: not known slower,
  but known not faster than S by more than the margin and its zone (an indifference zone,
  as in Bechhofer's selection of the best: choosing S costs at most that, a difference a
  fusing decision would not act on either); **loop** when every strategy is known not to beat the
  margin; **marginal** when the strategies that might beat it are known to lie within
  MARGINAL_ZONE of the margin (fusing gains about the margin; either choice costs little);
  else **open**. Given time every point settles: an interval that straddles the margin
  shrinks until it lies within the zone. Fuse or capture follows the same rule with the
  fastest control in the baseline's place: 'fuse', 'capture' (fusing is known not to gain
  the margin over the captured loop), 'either' (it gains about the margin) or 'open'.

Repeated looks. The rule looks at the data at geometric round counts (10, 20, 40, ... up to
the timer's max_samples) and once more when the budget is spent, and could stop at any of
them. Each look's intervals are at level 1 - ALPHA / looks (Bonferroni), so the chance that
any interval of a speedup misses its true value at any look, the one the run stopped at
included, is at most ALPHA: optional stopping does not erode the 95%. The intervals a result
reports are those of the look it stopped at, at that level (`level`). scripts/coverage.py
measures their coverage under this rule.

The speedup is the median of the per-round ratios (core.stats.paired_ratio), its interval
from order statistics: distribution-free, and valid at ten rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dataclasses_json import dataclass_json

from ..core.roles import BASELINE
from ..core.stats import MARGINAL_ZONE, MIN_EFFECT, paired_ratio
from ..measurement.settings import RunSettings
from ..measurement.timing import Look, StopRule, TimingConfig

__all__ = [
    "ALPHA",
    "MARGIN",
    "ZONE",
    "Call",
    "Decision",
    "looks",
    "decision_level",
    "level_of",
    "stop_rule",
    "classify",
    "decide",
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
# The marginal zone, 1.029 to 1.071: a speedup known to lie here gains about the margin.
ZONE = (MARGIN / (1 + MARGINAL_ZONE), MARGIN * (1 + MARGINAL_ZONE))

KINDS = ("fuse", "marginal", "loop", "open")
CAPTURE_KINDS = ("fuse", "capture", "either", "open")


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
        call = decide(samples, strategies, level, controls)
        return Look(call.settled, frozenset(settled_parts(samples, call, strategies, controls, level)))

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

    kind: 'fuse' (with `strategy`), 'marginal' (`strategy` the fastest within the margin's zone),
    'loop' (no strategy beats the margin), or 'open' (undecided when the budget ran out, or
    over a point's passes taken together: results.analysis; `strategy` the provisional best).
    ties: strategies not known slower than the winner, but known not faster by more than the
    margin. rivals: strategies that may be faster
    than the winner by more than the margin (the winner's identity is open). capture: at a
    group's largest N, the best strategy against the fastest control: 'fuse', 'capture',
    'either' or 'open' (None where no control ran).
    """

    kind: str
    strategy: Optional[str] = None
    ties: List[str] = field(default_factory=list)
    rivals: List[str] = field(default_factory=list)
    capture: Optional[str] = None

    @property
    def settled(self) -> bool:
        return self.kind != "open" and not self.rivals and self.capture != "open"


@dataclass_json
@dataclass(frozen=True)
class Decision:
    """A point's decision and how it was reached: the Call; the rounds taken; the round count at
    which it settled (None: it never did); the intervals' level; the decisions of its group
    that it feeds ('crossover', 'winner', 'fuse_or_capture'; set when the result is analysed)."""

    call: Call
    rounds: int
    settled_at: Optional[int]
    level: float
    feeds: List[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.call.kind


def classify(lo: float, hi: float) -> str:
    """Where a speedup interval lies against the margin: 'beats' (wholly above it), 'marginal'
    (wholly within the zone around it), 'below' (wholly below it), else 'open'."""
    if lo > MARGIN:
        return "beats"
    if ZONE[0] <= lo and hi <= ZONE[1]:
        return "marginal"
    if hi < MARGIN:
        return "below"
    return "open"


Samples = Mapping[str, Sequence[float]]


def decide(samples: Samples, strategies: Sequence[str], level: float, controls: Sequence[str] = ()) -> Call:
    """The Call the samples (ms per call, paired by round; 'baseline' among them) support at
    `level`, over the correct `strategies` that were timed; with `controls`, the fuse-or-capture
    answer too."""
    timed = [s for s in strategies if s in samples]
    if not timed:
        return Call("loop")
    ratios = {s: paired_ratio(samples[BASELINE], samples[s], level) for s in timed}
    kind, strategy = kind_of(ratios)
    ties: List[str] = []
    rivals: List[str] = []
    if kind == "fuse":
        # known slower than the winner outright: its whole interval below the winner's
        below_winner = [s for s in timed if ratios[s][2] < ratios[strategy][1]]
        others = [s for s in timed if s != strategy and s not in below_winner]
        ties, rivals = _against(samples, strategy, others, level)
    # where fusing loses, capturing the loop is all there is to weigh
    capture = decide_capture(samples, strategy, controls, level) if controls and kind != "loop" else None
    return Call(kind, strategy, ties, rivals, capture)


def kind_of(ratios: Mapping[str, Tuple[float, float, float]]) -> Tuple[str, str]:
    """The decision on fusing that speedups (strategy -> (median, low, high); at least one)
    support, with its strategy: 'fuse' with the fastest that beats the margin; 'loop' (every
    one known not to) with the fastest; 'marginal' (every one known not to, or within the
    zone) with the fastest within the zone; else 'open' with the fastest. `decide` applies it
    to a pass's intervals, results.analysis to a point's intervals over several passes: one
    rule, so that no label says more than the intervals it is shown with."""
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


def decide_capture(samples: Samples, strategy: str, controls: Sequence[str], level: float) -> str:
    """Fuse with `strategy`, or capture the loop with the fastest control? The fuse decision's
    rule with the control in the baseline's place: 'fuse' when the strategy is known faster
    beyond the margin, 'capture' when it is known not to be (capturing the loop is enough),
    'either' when the speedup is known to lie in the zone around the margin, else 'open'."""
    timed = [c for c in controls if c in samples]
    if not timed or strategy not in samples:
        return "either"
    control = min(timed, key=lambda c: _median(samples[c]))
    _, lo, hi = paired_ratio(samples[control], samples[strategy], level)
    return {"beats": "fuse", "below": "capture", "marginal": "either", "open": "open"}[classify(lo, hi)]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def compatible(first: Call, second: Call) -> bool:
    """Whether two passes agree on fusing at a point: a win against a loop is a flip; a marginal
    or open pass contradicts nothing, though over both passes the point may be undecided
    (results.analysis.disputed). Which strategy wins is `same_winner`'s question."""
    kinds = {first.kind, second.kind}
    return bool(kinds & {"open", "marginal"}) or len(kinds) == 1


def same_winner(first: Call, second: Call) -> bool:
    """Whether two passes that both fuse name one winner (or winners they found tied)."""
    if first.kind != "fuse" or second.kind != "fuse":
        return True
    return first.strategy == second.strategy or second.strategy in first.ties or first.strategy in second.ties
