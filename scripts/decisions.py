"""How long did each point measure, and what for? Per point of a results file: the rounds taken,
the decision, the round count at which it settled, and the interval it settled on; at the end,
the share of all rounds (every pass) that the health monitor called disturbed.

Then the rounds at the points whose decision is clear (the best strategy's speedup above 1.5x
or below 0.7x): with the decision rule they should stop at the first looks, where sampling
for 2% medians took 90 to 113 rounds (a median over the quick preset's points, 2026-11).

Last, the check that every label keeps its promise: no point reported marginal whose intervals
do not support it (one lies outside the marginal zone, 1.029 to 1.071, where 'fusing gains
about 5%, either choice costs little' would not hold). It prints their count and exits 1 if any.

--replay relabels instead every point of the files given (a folder: every *.json under it)
by the ε-regret rule (`--regret`, 2% by default): its own pass rebuilt from its samples and
decided at ε, the other pass (where it was confirmed) decided at ε from the intervals its
record holds, the two taken together as the runner takes them. It prints per file how many
labels change and which way (stored -> ε: marginal -> loop, open -> fuse, ...) and the ops
RELIABLE before and after, then the changes over all files. A point whose passes then call for
a third is marked 'third pass due': a file holds no third measurement to replay. A file that
is no results file is named and passed over. `--regret none` replays by the rule before regret
bounds instead (a margin and a marginal zone around it), the other way round.

    python scripts/decisions.py [--replay [--regret 0.02|none]] PATH [PATH ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import List, Optional, Tuple

from wide_tessera import WideTesseraError, load_results
from wide_tessera.core.job import params_text
from wide_tessera.core.stats import REGRET
from wide_tessera.reports.answer import decision_cell
from wide_tessera.reports.text import format_table
from wide_tessera.results import analysis, passes
from wide_tessera.results.decisions import ZONE, Call
from wide_tessera.results.schema import MARGINAL, BenchmarkResult, PointResult


def broken_promise(point: PointResult) -> bool:
    """Reported marginal, while the intervals it reports support another decision
    (analysis.reported_kind): one of them lies outside the marginal zone."""
    return point.winner == MARGINAL and analysis.reported_kind(point)[0] != MARGINAL


def label(point: PointResult) -> str:
    if point.unstable or point.disturbed:
        return "unstable" if point.unstable else "disturbed"
    return point.decision.kind if point.decision else point.winner


def decided_at(other: PointResult, epsilon: Optional[float]) -> PointResult:
    """A pass known only from its record (no samples), decided at ε from the intervals it holds
    (analysis.reported_kind); its ties and rivals kept where its winner stays, else none."""
    if other.decision is None or not other.timings:
        return other
    decision = dataclasses.replace(other.decision, epsilon=epsilon)
    kind, strategy, regret, against = analysis.reported_kind(dataclasses.replace(other, decision=decision))
    was = decision.call
    kept = strategy == was.strategy
    call = Call(kind, strategy, was.ties if kept else [], was.rivals if kept else [], was.capture, regret, against)
    return dataclasses.replace(other, decision=dataclasses.replace(decision, call=call))


def relabelled(point: PointResult, epsilon: Optional[float]) -> Tuple[PointResult, bool]:
    """The point as the ε rule decides its stored passes, and whether they call for a third
    that the file does not hold (a point a third pass settled holds it and its partner)."""
    own = passes.own_pass(point, epsilon)
    if own is None:  # no samples or no decision: nothing to decide again
        return point, False
    c = point.confirmation
    if c is None:
        return dataclasses.replace(own, flags=point.flags), False
    other = decided_at(passes.recorded_pass(own, c), epsilon)
    both = (other, own) if c.replaced else (own, other)
    due = passes.stored_passes(point) is not None and passes.disputed(*both)
    return dataclasses.replace(passes.confirmed(*both), flags=point.flags), due


def replay(result: BenchmarkResult, epsilon: Optional[float]) -> Tuple[BenchmarkResult, BenchmarkResult, Counter]:
    """The result analysed as stored, and relabelled by the ε rule; and the count of (stored
    label, label at ε) over its points."""
    points, changes = [], Counter()
    for p in result.points:
        new, due = relabelled(p, epsilon)
        changes[label(p), label(new)] += 1
        changes["third pass due", ""] += due
        points.append(new)
    run = {k: getattr(result, k) for k in ("op", "strategies", "environment", "timer", "settings", "duration_s",
                                          "memory_method", "complete", "peaks", "runs")}  # fmt: skip
    return analysis.result_of(result.points, **run), analysis.result_of(points, **run), changes


def results_files(paths: List[str]) -> List[Path]:
    """The files named, and every *.json under a folder named; each once."""
    found: List[Path] = []
    for path in map(Path, paths):
        found += sorted(path.rglob("*.json")) if path.is_dir() else [path]
    return list({p.resolve(): p for p in found}.values())


def changed_text(counts: Counter) -> str:
    """'marginal -> loop: 3, open -> fuse: 1; third pass due: 2', or 'none'."""
    due = counts["third pass due", ""]
    moved = ", ".join(f"{a} -> {b}: {k}" for (a, b), k in sorted(counts.items()) if a != b and b) or "none"
    return moved + (f"; third pass due: {due}" if due else "")


def point_count(counts: Counter) -> Tuple[int, int]:
    """(points, unchanged) of a replay's counts."""
    return sum(k for (_, b), k in counts.items() if b), sum(k for (a, b), k in counts.items() if a == b)


def replay_table(paths: List[str], epsilon: Optional[float]) -> str:
    rows, total = [], Counter()
    for path in results_files(paths):
        try:
            results = load_results(path)
        except WideTesseraError as e:
            print(f"passed over: {e}", file=sys.stderr)
            continue
        if not results:
            continue
        old, new, counts = zip(*(replay(r, epsilon) for r in results))
        changes = sum(counts, Counter())
        total += changes
        reliable = f"{sum(r.reliable for r in old)} -> {sum(r.reliable for r in new)} of {len(old)}"
        rows.append([str(path), *map(str, point_count(changes)), changed_text(changes), reliable])
    rule = "the rule before regret bounds" if epsilon is None else f"ε {epsilon:g}"
    head = ["file", "points", "unchanged", f"labels changed (stored -> by {rule}: count)", "ops RELIABLE"]
    points, same = point_count(total)
    return "\n".join([
        format_table(head, rows),
        f"over {len(rows)} file(s): {points} points, {same} unchanged; {changed_text(total)}",
    ])  # fmt: skip


def regret_value(text: str) -> Optional[float]:
    """--regret's value: a fraction, or 'none' (the rule before regret bounds)."""
    if text == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a fraction (0.02) nor none") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--replay", action="store_true", help="relabel every point by the ε-regret rule")
    parser.add_argument(
        "--regret", type=regret_value, default=REGRET, help="--replay's ε, or none: the rule before it (%(default)s)"
    )
    args = parser.parse_args()
    try:
        if args.replay:
            print(replay_table(args.files, args.regret))
            return
        results = [r for path in args.files for r in load_results(path)]
    except WideTesseraError as e:
        sys.exit(f"decisions.py: {e}")
    rows, clear, rest = [], [], []
    for r in results:
        for p in r.points:
            if p.decision is None or not p.timings:
                continue
            best = p.best_strategy
            speedup = p.speedups.get(best) if best else None
            interval = p.speedup_ci.get(best) if best else None
            rounds = p.decision.rounds
            (clear if speedup is not None and (speedup > 1.5 or speedup < 0.7) else rest).append(rounds)
            rows.append([
                r.op, str(p.n), params_text(p.params), str(rounds),
                "-" if p.decision.settled_at is None else str(p.decision.settled_at),
                decision_cell(p),
                "-" if speedup is None else f"{best} {speedup:.2f}x [{interval[0]:.2f},{interval[1]:.2f}]",
            ])  # fmt: skip
    if not rows:
        sys.exit("decisions.py: no point of these files records a decision (files from before decisions)")
    print(format_table(["op", "N", "parameters", "rounds", "settled at", "decision", "best strategy"], rows))
    for what, counts in (("clear (best above 1.5x or below 0.7x)", clear), ("the others", rest)):
        if counts:
            print(f"{what}: {len(counts)} points, median {statistics.median(counts):g} rounds, max {max(counts)}")
    # Every pass's rounds, kept and thrown away: on an idle machine the share called disturbed is
    # the health monitor's false-alarm rate (issue 38's target: at most 1% over a quick run).
    healths = [h for r in results for p in r.points for h in (p.health, p.confirmation and p.confirmation.health) if h]
    disturbed, kept = sum(h.disturbed_rounds for h in healths), sum(h.rounds for h in healths)
    if kept + disturbed:
        share = 100 * disturbed / (kept + disturbed)
        print(f"rounds called disturbed: {disturbed} of {kept + disturbed} ({share:.1f}%), over {len(healths)} passes")
    broken = [(r.op, p) for r in results for p in r.points if broken_promise(p)]
    zone = f"{ZONE[0]:.3f} to {ZONE[1]:.3f}"
    print(f"points reported marginal with an interval outside the marginal zone ({zone}): {len(broken)}")
    for op, p in broken:
        print(f"  {op} N={p.n} {params_text(p.params)}: {analysis.first_verdict(p)}")
    if broken:
        sys.exit(1)


if __name__ == "__main__":
    main()
