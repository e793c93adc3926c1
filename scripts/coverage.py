"""Do wide_tessera's speedup intervals contain the true ratio, and are its estimates unbiased?

For pairs of functions with equal costs and with known ratios, the true ratio comes
from long torch.utils.benchmark `blocked_autorange` runs, interleaved with ours
(A, B, then one wide_tessera paired measurement, and again). Each paired measurement
gives a speedup median(A) / median(B) with its 95% bootstrap interval, exactly as a
benchmark point does. Prints, per pair: the true ratio, the mean estimate and its
bias, and how many intervals contain the true ratio.
Target: at least 90% coverage, bias within 0.5%.

Pin it for a quiet measurement, e.g. `taskset -c 1 python scripts/coverage.py --threads 1`.

    python scripts/coverage.py [--runs 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.utils import benchmark as torch_benchmark

from wide_tessera.measurement.timing import measure_paired
from wide_tessera.reports.text import format_table
from wide_tessera.results.analysis import speedup_ci

Fn = Callable[[], object]


def pairs() -> List[Tuple[str, Fn, Fn]]:
    """(name, A, B): the speedup measured is time(A) / time(B)."""
    torch.manual_seed(0)
    lin, lin2 = nn.Linear(512, 512), nn.Linear(512, 512)
    x = torch.randn(16, 512)
    small, y = nn.Linear(64, 64), torch.randn(8, 64)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    return [
        ("equal: linear 512, two copies", lambda: lin(x), lambda: lin2(x)),
        ("equal: linear 64 (us-scale)", lambda: small(y), lambda: small(y)),
        ("2x: two matmuls 256 vs one", lambda: (a @ b, b @ a), lambda: a @ b),
        ("0.5x: one linear 512 vs two", lambda: lin(x), lambda: (lin(x), lin2(x))),
    ]


def _blocked_median(fn: Fn, seconds: float) -> float:
    return torch_benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=seconds
    ).median


def measure_pair(a: Fn, b: Fn, runs: int, truth_s: float) -> Dict[str, float]:
    truth_a, truth_b, estimates, covered = [], [], [], 0
    results = []
    for _ in range(runs):
        truth_a.append(_blocked_median(a, truth_s))
        truth_b.append(_blocked_median(b, truth_s))
        stats = measure_paired({"a": a, "b": b}).stats
        estimate = stats["a"].median_ms / stats["b"].median_ms
        results.append((estimate, speedup_ci(stats["a"].samples_ms, stats["b"].samples_ms)))
    true = statistics.median(truth_a) / statistics.median(truth_b)
    for estimate, (low, high) in results:
        estimates.append(estimate)
        covered += low <= true <= high
    mean = statistics.fmean(estimates)
    return {"true": true, "mean": mean, "bias": mean / true - 1, "covered": covered, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--truth-seconds", type=float, default=0.3, help="blocked_autorange time per block")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for name, a, b in pairs():
            r = measure_pair(a, b, args.runs, args.truth_seconds)
            rows.append(
                [name, f"{r['true']:.4f}", f"{r['mean']:.4f}", f"{r['bias']:+.2%}", f"{r['covered']}/{r['runs']}"]
            )
    print(f"{torch.get_num_threads()} thread(s), {args.runs} runs per pair")
    print(format_table(["pair", "true ratio", "mean estimate", "bias", "CI contains truth"], rows))


if __name__ == "__main__":
    main()
