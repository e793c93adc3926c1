"""How long did each point measure, and what for? Per point of a results file: the rounds taken,
the decision, the round count at which it settled, and the interval it settled on; at the end,
the share of all rounds (every pass) that the health monitor called disturbed.

Then the rounds at the points whose decision is clear (the best strategy's speedup above 1.5x
or below 0.7x): with the decision rule they should stop at the first looks, where sampling
for 2% medians took 90 to 113 rounds (a median over the quick preset's points, 2026-11).

    python scripts/decisions.py FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from wide_tessera import WideTesseraError, load_results
from wide_tessera.core.job import params_text
from wide_tessera.reports.answer import decision_cell
from wide_tessera.reports.text import format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    try:
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


if __name__ == "__main__":
    main()
