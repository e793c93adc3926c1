"""How long did each point measure, and what for? Per point of a results file: the rounds taken,
the decision, the round count at which it settled, and the interval it settled on; at the end,
the share of all rounds (every pass) that the health monitor called disturbed.

Then the rounds at the points whose decision is clear (the best strategy's speedup above 1.5x
or below 0.7x): with the decision rule they should stop at the first looks, where sampling
for 2% medians took 90 to 113 rounds (a median over the quick preset's points, 2026-11).

Last, the check that every label keeps its promise: no point reported marginal whose intervals
do not support it (one lies outside the marginal zone, 1.029 to 1.071, where 'fusing gains
about 5%, either choice costs little' would not hold). It prints their count and exits 1 if any.

--replay relabels instead the points of files written before that rule (issue 48) from their
stored passes: each confirmed point's own pass rebuilt from its samples, the other from its
record, taken together by today's rule; it prints how many labels change (old -> new) and the
ops RELIABLE before and after. A point today's runner would measure a third time is marked
'third pass due': a file holds no third measurement to replay.

    python scripts/decisions.py [--replay] FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import Counter
from typing import List, Tuple

from wide_tessera import WideTesseraError, load_results
from wide_tessera.core.job import params_text
from wide_tessera.reports.answer import decision_cell
from wide_tessera.reports.text import format_table
from wide_tessera.results import analysis
from wide_tessera.results.decisions import ZONE
from wide_tessera.results.schema import MARGINAL, BenchmarkResult, PointResult


def broken_promise(point: PointResult) -> bool:
    """Reported marginal, while the intervals it reports support another decision
    (analysis.reported_kind): one of them lies outside the marginal zone."""
    return point.winner == MARGINAL and analysis.reported_kind(point)[0] != MARGINAL


def label(point: PointResult) -> str:
    if point.unstable or point.disturbed:
        return "unstable" if point.unstable else "disturbed"
    return point.decision.kind if point.decision else point.winner


def replay(result: BenchmarkResult) -> Tuple[BenchmarkResult, BenchmarkResult, Counter]:
    """The result analysed today as stored, and relabelled by today's rule from each point's
    stored passes; and the count of (old label, new label) over its points."""
    points, changes = [], Counter()
    for p in result.points:
        both = analysis.stored_passes(p)  # None for a point a third pass settled: it holds that pass and its partner
        new = p if both is None else dataclasses.replace(analysis.confirmed(*both), flags=p.flags)
        due = both is not None and analysis.disputed(*both)
        changes[label(p), label(new) + (", third pass due" if due else "")] += 1
        points.append(new)
    run = {k: getattr(result, k) for k in ("op", "strategies", "environment", "timer", "settings", "duration_s",
                                          "memory_method", "complete", "peaks", "runs")}  # fmt: skip
    return analysis.result_of(result.points, **run), analysis.result_of(points, **run), changes


def replay_table(paths: List[str]) -> str:
    rows = []
    for path in paths:
        old, new, counts = zip(*(replay(r) for r in load_results(path)))
        total = sum(counts, Counter())
        changed = ", ".join(f"{a} -> {b}: {k}" for (a, b), k in sorted(total.items()) if a != b) or "none"
        same = sum(k for (a, b), k in total.items() if a == b)
        reliable = f"{sum(r.reliable for r in old)} -> {sum(r.reliable for r in new)} of {len(old)}"
        rows.append([path.rsplit("/", 1)[-1], str(sum(total.values())), str(same), changed, reliable])
    return format_table(["file", "points", "unchanged", "labels changed (old -> new: count)", "ops RELIABLE"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--replay", action="store_true", help="relabel old files' points by today's rule")
    args = parser.parse_args()
    try:
        if args.replay:
            print(replay_table(args.files))
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
