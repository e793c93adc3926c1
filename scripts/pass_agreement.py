"""Do a point's two passes measure the same speedup, within the intervals they claim?

A confirmed point was measured twice in one run, each pass on models, inputs and allocations
built afresh from a seed of its own (the run's seed, then seed + 1): two independent
measurements, as two runs of the tool would be. If each pass's interval (at the decision's
level, 99.4% at 10 looks) only reflected sampling noise, and nothing differed between passes
but that noise, two passes' intervals would be disjoint far less often than 1 - level per
strategy. Where they are disjoint more often, something that changes from one build of the
models to the next (an allocation's alignment, one draw of routing) moves the speedup by more
than the interval says, and a within-run interval would not cover the next run.

Per file: the strategy pairs of points whose two passes were both clean, how many had disjoint
intervals, and the share; then the pairs that were disjoint.

    python scripts/pass_agreement.py FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import sys
from typing import List

from wide_tessera import WideTesseraError, load_results
from wide_tessera.core.job import params_text
from wide_tessera.core.roles import BASELINE
from wide_tessera.core.stats import paired_ratio
from wide_tessera.reports.text import format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    rows: List[List[str]] = []
    disjoint_pairs: List[str] = []
    for path in args.files:
        try:
            results = load_results(path)
        except WideTesseraError as e:
            sys.exit(f"pass_agreement.py: {e}")
        pairs = disjoint = 0
        for r in results:
            for p in r.points:
                c = p.confirmation
                clean = p.health is not None and p.health.cleaned and c is not None and c.health is not None
                if not clean or not c.health.cleaned:
                    continue
                level = p.decision.level if p.decision is not None else 0.95
                base = p.stats[BASELINE].samples_ms
                for s in p.speedup_ci:
                    if s not in c.speedup_ci:
                        continue
                    # the point's own pass, from its samples: its interval in the file spans both passes
                    _, lo, hi = paired_ratio(base, p.stats[s].samples_ms, level)
                    lo2, hi2 = c.speedup_ci[s]
                    pairs += 1
                    if hi < lo2 or hi2 < lo:
                        disjoint += 1
                        where = f"{r.op} N={p.n} {params_text(p.params)} {s}"
                        disjoint_pairs.append(
                            f"{where}: {p.speedups[s]:.3f} [{lo:.3f},{hi:.3f}] vs "
                            f"{c.speedups[s]:.3f} [{lo2:.3f},{hi2:.3f}]"
                        )
        share = f"{100 * disjoint / pairs:.1f}%" if pairs else "-"
        rows.append([path, str(pairs), str(disjoint), share])
    print(format_table(["file", "strategy pairs, both passes clean", "disjoint intervals", "share"], rows))
    if disjoint_pairs:
        print("disjoint (first pass vs confirmation):")
        print("\n".join(f"  {line}" for line in disjoint_pairs))


if __name__ == "__main__":
    main()
