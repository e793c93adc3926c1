"""A/A: two 'strategies' that are the baseline's own loop must never be faster and never cross.

An op whose two wide strategies run the N separate calls themselves (plus one call of
overhead) is measured RUNS times with the decision rule, quietly and then with K processes
burning a CPU each beside it. Counts, per condition: points where a twin was called faster,
groups that crossed, the points' decisions ('loop', what an A/A should say, or 'open'; a
'fuse' within ε of the margin would be a false one); and the median rounds. Target: never
faster, never a crossover, never 'fuse'.

    python scripts/aa.py [--runs 20] [--load 1] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
from typing import List, Optional, Sequence

import torch
from repeatability import cpu_burners  # scripts/ is on the path of a script run from it
from torch import nn

from wide_tessera import SweepParams, WideOp, register
from wide_tessera.reports.text import format_table
from wide_tessera.sweep.runner import run


class LoopTwins(WideOp, nn.Module):
    """The N separate calls, twice, as two strategies, plus one wrapper call: an A/A test
    (tests/test_trust.py measures it too). Registered by main, not on import."""

    BENCHMARK_STRATEGIES = ("twin_a", "twin_b")
    BENCHMARK_SWEEPS = {"aa": SweepParams.of([1, 4, 16], batch=[64], d=[256])}

    def __init__(self, modules: Sequence[nn.Module], strategy: Optional[str] = None):
        super().__init__()
        self.models, self.strategy = nn.ModuleList(modules), self.check_strategy(strategy)

    @classmethod
    def from_modules(cls, modules, strategy=None):
        return cls(modules, strategy)

    def pack(self, inputs):
        return list(inputs)

    def unpack(self, output):
        return output

    def forward(self, xs: List[torch.Tensor]) -> List[torch.Tensor]:
        return [m(x) for m, x in zip(self.models, xs)]

    @classmethod
    def bench_model(cls, d, **_):
        return nn.Linear(d, d)

    @classmethod
    def bench_inputs(cls, n, batch, d, **_):
        return [torch.randn(batch, d) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=1, metavar="K", help="busy processes in the loaded condition")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    register("aa_twins")(LoopTwins)
    rows = []
    for load in (0, args.load):
        faster = crossed = points = 0
        kinds: dict = {}
        rounds = []
        with cpu_burners(load):
            for seed in range(args.runs):
                r = run(LoopTwins.benchmark_job("aa"), seed=seed, verbose=False, controls=False)
                for p in r.points:
                    points += 1
                    faster += any(v == "faster" for v in p.verdicts.values())
                    kinds[p.decision.kind] = kinds.get(p.decision.kind, 0) + 1
                    rounds.append(p.decision.rounds)
                crossed += sum(g.crossover_n is not None for g in r.groups)
        rows.append([
            f"{load} busy", str(args.runs), str(points), str(faster), str(crossed),
            ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())), f"{statistics.median(rounds):g}",
        ])  # fmt: skip
    print(f"{torch.get_num_threads()} thread(s), {args.runs} runs of 3 points each per condition")
    print(format_table(["load", "runs", "points", "a twin faster", "crossovers", "decisions", "median rounds"], rows))


if __name__ == "__main__":
    main()
