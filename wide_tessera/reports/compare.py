"""Two runs side by side: what got faster or slower, where the crossover moved, and what differs.

The rules, which the README repeats:

* Points are matched by op, parameters and N; each callable (the baseline, every strategy,
  every control) timed in both runs is compared.
* Its change is new median / base median, with a 95% interval. The verdict follows the
  rule of every speedup: 'faster' or 'slower' when the whole interval of base / new lies
  beyond the 5% margin (MIN_EFFECT), else 'same'. A point disturbed or unstable in either
  run has no verdict ('unknown'): it cannot show a change, nor hide one.
* The interval has two parts. The sampling noise of each run: a bootstrap that resamples
  each run's samples on its own (two runs are independent). And the noise between two
  measurements of the same thing, which no run's samples show: two identical back-to-back
  `gemm --preset ci` runs on the 2-core CI machine differed by +8% to +23% at N=1 and 4
  (every callable of a point together), with bootstrap intervals as narrow as +-3%. The
  confirmation pass measures points twice, independently, within each run; the root mean
  square of log(second / first) over every callable of every confirmed point of both runs
  is that noise for a base-new difference (in that run: 11%, so +-24% at 95%). It widens
  each side of the interval in quadrature. Runs without confirmations say so: their
  intervals then hold only the sampling noise.
* A strategy correct in the base run and incorrect or failing in the new one is 'broken'.
* A group's crossover moved later when the new run's is a larger N, or when the new run
  never crosses where the base run did. A move only across marginal points is marked
  'within marginal' ("fuse from N=4; N=2 marginal" against "fuse from N=2"): two runs of the
  same code on a noisy machine do that, and it still counts as moved.
* The N separate calls (the baseline) are torch's own ops: where they moved too, at half an
  op's points or more and in the same direction, the op shifted as a whole. A machine that
  ran slower during one run looks exactly like that (two back-to-back quick runs of
  unchanged code: every callable of flash_attention +21% in the second, speedups unchanged,
  nothing in the health readings), so such ops are named with the median change of their
  speedups, which a machine-wide shift leaves alone. Their changes still count: a slower
  torch looks the same.
* `regressions(pct)`: every 'slower' change whose median slowdown exceeds pct percent,
  every 'broken' strategy, every crossover moved later. `wide_tessera compare
  --fail-on-regression PCT` exits 1 when there is one.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core.job import group_key, params_text, point_key
from ..core.roles import BASELINE
from ..results import alike
from ..results.analysis import MIN_EFFECT, verdict
from ..results.schema import BenchmarkResult, GroupResult, PointResult
from .answer import crossover_text, crossovers_agree, n_or_never
from .markdown import table as md_table
from .text import format_table

__all__ = [
    "Change",
    "CrossoverChange",
    "Comparison",
    "compare",
    "differences",
    "between_run_noise",
    "render",
    "against_previous",
]


@dataclass(frozen=True)
class Change:
    """One callable at one point in both runs. ratio: new median / base median; ci: its 95% interval."""

    op: str
    n: int
    params: Dict[str, object]
    callable: str
    base_ms: Optional[float]
    new_ms: Optional[float]
    ratio: Optional[float]
    ci: Optional[Tuple[float, float]]
    verdict: str  # faster, slower, same, unknown, broken
    note: str = ""
    # new speedup / base speedup, for a strategy or control with a speedup in both runs
    speedup_change: Optional[float] = None

    @property
    def percent(self) -> Optional[float]:
        return None if self.ratio is None else 100 * (self.ratio - 1)


@dataclass(frozen=True)
class CrossoverChange:
    """A parameter group's crossover N (None: never crosses) in both runs; `agree`: their ranges
    with the marginal points (answer.crossover_range) overlap, so that the strict crossover
    moved only across points that gain about the margin: two runs of the same code on a noisy
    machine do that. The gate still counts such a move later: it may be a strategy that lost
    its clear win, and a gate errs toward saying so."""

    op: str
    params: Dict[str, object]
    base: Optional[int]
    new: Optional[int]
    agree: bool = False

    @property
    def moved_later(self) -> bool:
        return self.base is not None and (self.new is None or self.new > self.base)

    @property
    def moved(self) -> str:
        """'LATER', 'earlier' or '', and ', within marginal' where the ranges overlap."""
        if self.base == self.new:
            return ""
        return ("LATER" if self.moved_later else "earlier") + (", within marginal" if self.agree else "")


@dataclass
class Comparison:
    """changes: every callable at every matched point. noise / noise_pairs: the between-measurement
    noise (root mean square of log ratios) and the number of repeated measurements it comes from
    (0: none, and the intervals hold only the sampling noise)."""

    changes: List[Change]
    crossovers: List[CrossoverChange]
    thresholds: Dict[str, Tuple[Optional[int], Optional[int]]]
    differences: List[str]
    unmatched: List[str] = field(default_factory=list)
    noise: float = 0.0
    noise_pairs: int = 0

    def regressions(self, percent: float) -> List[str]:
        """What `--fail-on-regression percent` fails on, one line each."""
        lines = [
            f"{c.op} N={c.n} {params_text(c.params)} {c.callable}: {c.percent:+.1f}% slower (limit {percent:g}%)"
            for c in self.changes
            if c.verdict == "slower" and c.percent > percent
        ]
        lines += [
            f"{c.op} N={c.n} {params_text(c.params)} {c.callable}: {c.note}"
            for c in self.changes
            if c.verdict == "broken"
        ]
        lines += [
            f"{g.op} {params_text(g.params)}: crossover moved from N={g.base} to "
            + ("never" if g.new is None else f"N={g.new}")
            for g in self.crossovers
            if g.moved_later
        ]
        return lines

    def shifted_ops(self) -> Dict[str, Tuple[float, int, int, Optional[float]]]:
        """Ops whose baseline moved significantly, one way, at half their points or more:
        op -> (median baseline change in percent, points where it moved, points, median
        speedup change in percent, None without speedups)."""
        out = {}
        for op in dict.fromkeys(c.op for c in self.changes):
            base = [c for c in self.changes if c.op == op and c.callable == BASELINE and c.ratio is not None]
            moved = max((sum(c.verdict == v for c in base) for v in ("slower", "faster")), default=0)
            if base and 2 * moved >= len(base):
                speedups = [c.speedup_change for c in self.changes if c.op == op and c.speedup_change is not None]
                out[op] = (
                    100 * (_median([c.ratio for c in base]) - 1),
                    moved,
                    len(base),
                    100 * (_median(speedups) - 1) if speedups else None,
                )
        return out

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for c in self.changes:
            out[c.verdict] = out.get(c.verdict, 0) + 1
        return out


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _untrusted(point: PointResult) -> Optional[str]:
    if point.disturbed:
        return "disturbed"
    if point.unstable:
        return "unstable"
    return None


# z of a two-sided 95% interval.
_Z95 = 1.96


def between_run_noise(results: Sequence[BenchmarkResult]) -> Tuple[float, int]:
    """Root mean square of log(second / first median) over every callable of every confirmed point,
    and how many there were: the spread of the difference between two independent measurements."""
    logs = [
        math.log(p.confirmation.timings[s] / p.timings[s])
        for r in results
        for p in r.points
        if p.confirmation is not None
        for s in p.timings
        if s in p.confirmation.timings
    ]
    return (math.sqrt(sum(x * x for x in logs) / len(logs)), len(logs)) if logs else (0.0, 0)


def _widened(ratio: float, lo: float, hi: float, noise: float) -> Tuple[float, float]:
    """The interval (lo, hi) around `ratio`, each side widened in quadrature by the 95% noise band."""
    c, band = math.log(ratio), _Z95 * noise
    return (
        math.exp(c - math.hypot(c - math.log(lo), band)),
        math.exp(c + math.hypot(math.log(hi) - c, band)),
    )


def _change(op: str, base: PointResult, new: PointResult, name: str, noise: float) -> Optional[Change]:
    """The change of one callable between two measurements of a point; None where neither timed it."""
    where = dict(op=op, n=base.n, params=base.params, callable=name)
    if base.correct.get(name, name == BASELINE) and name not in new.stats and name in base.stats:
        failure = new.failures.get(name) or new.failures.get("point")
        if failure is None or failure.kind != "skipped":
            why = (
                str(failure) if failure else f"incorrect: {new.checks[name].error}" if name in new.checks else "not run"
            )
            return Change(
                **where, base_ms=base.timings[name], new_ms=None, ratio=None, ci=None, verdict="broken", note=why
            )
    if name not in base.stats or name not in new.stats:
        return None
    b, s = base.stats[name], new.stats[name]
    if min(b.median_ms, s.median_ms, *b.samples_ms, *s.samples_ms) <= 0:  # a damaged file: no ratio to draw
        return Change(
            **where,
            base_ms=b.median_ms,
            new_ms=s.median_ms,
            ratio=None,
            ci=None,
            verdict="unknown",
            note="a time of zero",
        )
    ratio = s.median_ms / b.median_ms
    lo, hi = _widened(b.median_ms / s.median_ms, *_between_runs_ci(b.samples_ms, s.samples_ms), noise)  # base / new
    untrusted = [f"{why} in the {run} run" for run, p in (("base", base), ("new", new)) if (why := _untrusted(p))]
    return Change(
        **where,
        base_ms=b.median_ms,
        new_ms=s.median_ms,
        ratio=ratio,
        ci=(1 / hi, 1 / lo),
        verdict="unknown" if untrusted else verdict((lo, hi)),
        note="; ".join(untrusted),
        speedup_change=new.speedups[name] / base.speedups[name]
        if name in base.speedups and name in new.speedups
        else None,
    )


def differences(base: BenchmarkResult, new: BenchmarkResult) -> List[str]:
    """What differs between how two results were measured (results.alike), a line each."""
    return [f"{base.op}: {what}: {x} -> {y}" for what, x, y in alike.differences(base, new)]


def compare(base: Sequence[BenchmarkResult], new: Sequence[BenchmarkResult]) -> Comparison:
    """Compare every op found in both runs, point by point and group by group."""
    new_by_op = {r.op: r for r in new}
    base_ops = {r.op for r in base}
    noise, pairs = between_run_noise([*base, *new])
    comparison = Comparison(
        [], [], {}, [], [f"{op}: only in the new run" for op in new_by_op if op not in base_ops], noise, pairs
    )
    for b in base:
        n = new_by_op.get(b.op)
        if n is None:
            comparison.unmatched.append(f"{b.op}: only in the base run")
            continue
        comparison.differences += differences(b, n)
        new_points = {point_key(p.n, p.params): p for p in n.points}
        for p in b.points:
            q = new_points.pop(point_key(p.n, p.params), None)
            if q is None:
                comparison.unmatched.append(f"{b.op} N={p.n} {params_text(p.params)}: only in the base run")
                continue
            names = dict.fromkeys([BASELINE, *p.stats, *p.correct, *q.stats])
            comparison.changes += [c for name in names if (c := _change(b.op, p, q, name, noise)) is not None]
        comparison.unmatched += [
            f"{b.op} N={q.n} {params_text(q.params)}: only in the new run" for q in new_points.values()
        ]
        comparison.crossovers += [
            CrossoverChange(b.op, g.params, g.crossover_n, h.crossover_n, crossovers_agree(b, g, n, h))
            for g, h in _group_pairs(b, n)
        ]
        comparison.thresholds[b.op] = (b.recommended_threshold, n.recommended_threshold)
    return comparison


def _group_pairs(base: BenchmarkResult, new: BenchmarkResult) -> List[Tuple[GroupResult, GroupResult]]:
    """Each parameter group of `base` that `new` measured too, with `new`'s, in `base`'s order."""
    new_groups = {group_key(g.params): g for g in new.groups}
    return [(g, new_groups[group_key(g.params)]) for g in base.groups if group_key(g.params) in new_groups]


def _change_cell(c: Change) -> str:
    if c.ratio is None:
        return c.note
    lo, hi = c.ci
    return f"{c.percent:+.1f}% [{100 * (lo - 1):+.1f}, {100 * (hi - 1):+.1f}]"


def render(comparison: Comparison, as_markdown: bool = False, fail_percent: Optional[float] = None) -> str:
    """The comparison for a terminal, or as Markdown for a pull-request comment.

    Changes with a verdict other than 'same' come first; the 'same' ones follow."""
    head = _headline(comparison, fail_percent)
    header, rows = _change_rows(comparison)
    cross_header = ["op", "parameters", "base crossover N", "new crossover N", "moved"]
    cross_rows = [
        [g.op, params_text(g.params), n_or_never(g.base), n_or_never(g.new), g.moved] for g in comparison.crossovers
    ]
    thresholds = "thresholds: " + ", ".join(
        f"{op} {n_or_never(b)} -> {n_or_never(n)}" for op, (b, n) in comparison.thresholds.items()
    )
    notes = _notes(comparison)
    if as_markdown:
        parts = [f"**{head}**", md_table(header, rows), md_table(cross_header, cross_rows), thresholds]
        parts += [f"- {n}" for n in notes]
        return "\n\n".join(parts) + "\n"
    tables = [format_table(header, rows), format_table(cross_header, cross_rows)]
    return "\n".join([head, *tables, thresholds, *(f"NOTE: {n}" for n in notes)]) + "\n"


def _headline(comparison: Comparison, fail_percent: Optional[float]) -> str:
    """The counts of each verdict, the groups whose crossover moved later, the slower changes in
    ops whose baseline moved too, and the regression gate's answer where one is asked for."""
    counts = comparison.counts()
    head = "COMPARE: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("slower", "faster", "same", "unknown", "broken"))
    later = [g for g in comparison.crossovers if g.moved_later]
    head += f"; crossover moved later in {len(later)} of {len(comparison.crossovers)} groups"
    shifted = comparison.shifted_ops()
    in_shifted = sum(c.verdict == "slower" and c.op in shifted for c in comparison.changes)
    if in_shifted:
        head += f"; {in_shifted} of the slower in ops whose baseline moved too ({', '.join(shifted)}): see the notes"
    if fail_percent is None:
        return head
    regressions = comparison.regressions(fail_percent)
    gate = f"REGRESSION ({len(regressions)}) " if regressions else "NO REGRESSION "
    return f"{gate}(--fail-on-regression {fail_percent:g}%): {head}"


def _change_rows(comparison: Comparison) -> Tuple[List[str], List[List[str]]]:
    """The changes' table: broken, slower, faster, unknown, then same."""
    order = {"broken": 0, "slower": 1, "faster": 2, "unknown": 3, "same": 4}
    header = ["op", "N", "parameters", "callable", "base ms", "new ms", "change [95% CI]", "verdict", "speedup change"]
    rows = [
        [
            c.op,
            str(c.n),
            params_text(c.params),
            c.callable,
            "–" if c.base_ms is None else f"{c.base_ms:.4g}",
            "–" if c.new_ms is None else f"{c.new_ms:.4g}",
            _change_cell(c),
            c.verdict + (f" ({c.note})" if c.note and c.ratio is not None else ""),
            "" if c.speedup_change is None else f"{100 * (c.speedup_change - 1):+.1f}%",
        ]
        for c in sorted(comparison.changes, key=lambda c: order[c.verdict])
    ]
    return header, rows


def _notes(comparison: Comparison) -> List[str]:
    """What a reader needs to weigh the verdicts: the margin, the noise the intervals hold, ops
    whose baseline moved, how the runs differ and what is in one run only."""
    if comparison.noise_pairs:
        noise = (
            "intervals include the noise between two measurements: "
            f"+-{100 * (math.exp(_Z95 * comparison.noise) - 1):.0f}% "
            f"at 95%, from {comparison.noise_pairs} repeated measurements in the runs' confirmation passes"
        )
    else:
        noise = (
            "neither run has a confirmation pass (--confirm none): the intervals hold only the sampling noise "
            "within each run, not the larger noise between runs, and may call noise a change"
        )
    shifts = [
        f"{op}: the N separate calls (baseline) moved too: median {median:+.1f}% over {points} points, significantly "
        "at "
        f"{moved}; "
        + ("" if speedup is None else f"the speedups' median change is {speedup:+.1f}%. ")
        + "A machine that ran slower or faster during one of the runs looks exactly like this, and a change "
        "that slowed everything alike (torch, the device) does too: rerun both runs to tell them apart"
        for op, (median, moved, points, speedup) in comparison.shifted_ops().items()
    ]
    margin = (
        f"faster or slower only where the whole interval lies beyond a {100 * MIN_EFFECT:.0f}% margin "
        f"(under {100 * (1 / (1 + MIN_EFFECT) - 1):+.1f}% or over {100 * MIN_EFFECT:+.0f}%), else same"
    )
    return [margin, noise, *shifts, *(f"the runs differ: {d}" for d in comparison.differences), *comparison.unmatched]


def _between_runs_ci(base_ms: Sequence[float], new_ms: Sequence[float], seed: int = 0) -> Tuple[float, float]:
    """95% bootstrap interval of median(base) / median(new) for samples of two runs.

    Not the paired interval a point's speedup has (core.stats.paired_ratio): rounds of two runs
    do not pair, so each side is resampled on its own."""
    if min(len(base_ms), len(new_ms)) < 2:
        raise ValueError("a change's confidence interval needs at least 2 samples on each side")

    def ratio(b: np.ndarray, s: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.asarray(np.median(b, axis=axis) / np.median(s, axis=axis))

    from scipy import stats  # here: importing it cost every command about 1 s of its start (core.stats)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # identical samples make a degenerate, but valid, interval
        res = stats.bootstrap(
            (np.asarray(base_ms), np.asarray(new_ms)),
            ratio,
            paired=False,
            vectorized=True,
            n_resamples=2000,
            confidence_level=0.95,
            method="percentile",
            random_state=np.random.default_rng(seed),
        )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def against_previous(previous: Sequence[BenchmarkResult], new: Sequence[BenchmarkResult], name: str) -> Optional[str]:
    """Whether this run's crossovers hold in the run before it (`previous`, called `name`), over
    the ops both measured alike (`differences` finds nothing: the same machine, software,
    settings, seed and code); None where there is none.

    Why: within one run a point's two passes are a minute apart, but this 2-core VM holds a
    speed state for longer (conv1d at 32 channels: fuse from N=4 in one quick run, from N=2 in
    the next, both reliable, each run's passes agreeing, 2026-11-25), so only a second run can
    show such a decision moving. A group agrees when its crossover ranges overlap (marginal
    points count as either side: answer.crossovers_agree); a group either run flags (a point
    undecided, disturbed or unstable) already says its crossover is unsure, and is left out."""
    by_op = {r.op: r for r in previous}
    lines, matched, groups = [], 0, 0
    for n in new:
        b = by_op.get(n.op)
        if b is None or differences(b, n):
            continue
        for h, g in _group_pairs(b, n):
            matched += 1
            if h.problems or g.problems:
                continue
            groups += 1
            if not crossovers_agree(b, h, n, g):
                lines.append(f"  {n.op} {params_text(g.params)}: then {crossover_text(h)}, now {crossover_text(g)}")
    if not matched:
        return None
    head = (
        f"AGAINST THE PREVIOUS RUN ({name}, measured alike): {groups - len(lines)} of {groups} crossovers "
        f"agree ({matched - groups} of the {matched} groups left out: flagged in either run)"
    )
    if not lines:
        return head
    return "\n".join(
        [
            head + "; these moved between the runs, beyond their marginal points:",
            *lines,
            "  The machine's state moved them (both runs were measured alike): the Ns between the two answers are",
            "  marginal on this machine, and another run tells more (wide_tessera compare shows the points).",
        ]
    )
