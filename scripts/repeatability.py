"""Does a preset give the same crossovers twice in a row?

Runs the same preset twice back to back and prints, per op, how many parameter
groups got the same crossover N both times. Target: at least 90% on a CPU.

    python scripts/repeatability.py [--preset ci] [--device cpu] [ops ...]
"""

from __future__ import annotations

import argparse
import json
from typing import List

from wide_tessera import benchmark
from wide_tessera.bench.registry import op_names
from wide_tessera.bench.report import format_table


def _disagreements(first, second) -> List[str]:
    """For each group whose crossover differs: the points where one run won and the other did not."""
    lines = []
    for a, b in zip(first.groups, second.groups):
        if a.crossover_n == b.crossover_n:
            continue
        for pa, pb in zip(_points(first, a.params), _points(second, b.params)):
            if pa.fused_wins != pb.fused_wins:
                lines.append(f"{json.dumps(a.params)} N={pa.n}: {_speedup(pa)} vs {_speedup(pb)}")
    return lines


def _points(result, params):
    return [p for p in result.points if p.params == params]


def _speedup(point) -> str:
    if point.best_strategy is None:
        return "no correct strategy"
    low, high = point.speedup_ci[point.best_strategy]
    return f"{point.best_strategy} {point.best_speedup:.2f}x [{low:.2f},{high:.2f}] ({point.verdicts[point.best_strategy]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="*")
    parser.add_argument("--preset", default="ci")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    rows, agreed, total, why = [], 0, 0, []
    for op in args.ops or op_names():
        first, second = (benchmark(op, preset=args.preset, device=args.device, verbose=False) for _ in range(2))
        same = sum(a.crossover_n == b.crossover_n for a, b in zip(first.groups, second.groups))
        agreed, total = agreed + same, total + len(first.groups)
        rows.append([op, f"{same}/{len(first.groups)}", f"{first.crossover_n} / {second.crossover_n}"])
        why += [f"  {op} {line}" for line in _disagreements(first, second)]
    print(f"preset {args.preset}, device {first.device}")
    print(format_table(["op", "groups agreeing", "crossover_n run 1 / run 2"], rows))
    print(f"overall: {agreed}/{total} groups agree ({agreed / total:.0%})")
    if why:
        print("where the runs disagree (best strategy's speedup [95% CI], run 1 vs run 2):")
        print("\n".join(why))


if __name__ == "__main__":
    main()
