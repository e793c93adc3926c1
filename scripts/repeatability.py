"""Does a preset give the same crossovers twice in a row?

Runs the same preset twice back to back and prints, per op, how many parameter
groups got the same crossover N both times. Target: at least 90% on a CPU.

    python scripts/repeatability.py [--preset ci] [--device cpu] [ops ...]
"""

from __future__ import annotations

import argparse
import json

from wide_tessera import benchmark
from wide_tessera.bench.registry import op_names
from wide_tessera.bench.report import format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="*")
    parser.add_argument("--preset", default="ci")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    rows, agreed, total = [], 0, 0
    for op in args.ops or op_names():
        first, second = (benchmark(op, preset=args.preset, device=args.device, verbose=False) for _ in range(2))
        pairs = list(zip(first.groups, second.groups))
        same = sum(a.crossover_n == b.crossover_n for a, b in pairs)
        differing = [
            f"{json.dumps(a.params)}: {a.crossover_n} vs {b.crossover_n}"
            for a, b in pairs
            if a.crossover_n != b.crossover_n
        ]
        agreed, total = agreed + same, total + len(pairs)
        rows.append([op, f"{same}/{len(pairs)}", f"{first.crossover_n} / {second.crossover_n}", "; ".join(differing)])
    print(f"preset {args.preset}, device {first.device}")
    print(format_table(["op", "groups agreeing", "crossover_n run 1 / run 2", "differences"], rows))
    print(f"overall: {agreed}/{total} groups agree ({agreed / total:.0%})")


if __name__ == "__main__":
    main()
