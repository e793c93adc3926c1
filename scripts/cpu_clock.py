"""How far load moves a speedup timed by wall time, and timed by the measuring thread's CPU clock.

    python scripts/cpu_clock.py [--load 2] [--budget 1.5] [--cpu 0]

One torch thread pinned to one CPU (the setting in which the timer uses the CPU clock:
measurement.timing.cpu_clock). Four pairs of N=16 separate calls against the one wide call
that fuses them (Linear as bmm, LayerNorm, Conv2d as a grouped conv, Embedding with offsets)
are timed by measure_paired with each clock, in turn: quiet, beside LOAD processes that each
keep a CPU busy, and quiet again. Each cell is the paired speedup's median ratio and its 95%
interval; "moved" is how far the loaded ratio lies from the mean of the two quiet ones, and
"quiet drift" how far the two quiet ones lie from each other (what the machine does anyway).
The clocks alternate within each condition, so both see the same machine.

What the CPU clock cannot hide (caches and memory bandwidth shared with the load, the time
slices' cold starts) is what "moved" measures for it; a point timed beside load keeps its
'busy machine' note for that reason (results.reliability records it, never as a verdict).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from repeatability import cpu_burners  # scripts/ is on the path of a script run from it

from wide_tessera.core.stats import paired_ratio
from wide_tessera.measurement.timing import TimingConfig, measure_paired
from wide_tessera.reports.text import format_table

Fn = Callable[[], object]
N = 16


def pairs() -> Dict[str, Tuple[Fn, Fn]]:
    """name: (N separate calls, the one wide call)."""
    torch.manual_seed(0)
    x, w = torch.randn(N, 64, 256), torch.randn(N, 256, 256)
    h, g, b = torch.randn(N, 64, 512), torch.randn(N, 512), torch.randn(N, 512)
    img, k = torch.randn(1, N * 8, 32, 32), torch.randn(N * 8, 8, 3, 3)
    idx, table = torch.randint(0, 1000, (N, 256)), torch.randn(N, 1000, 64)
    offsets = (torch.arange(N) * 1000)[:, None]
    return {
        "linear 64x256x256": (lambda: [x[i] @ w[i] for i in range(N)], lambda: torch.bmm(x, w)),
        "layernorm 64x512": (
            lambda: [F.layer_norm(h[i], (512,), g[i], b[i]) for i in range(N)],
            lambda: F.layer_norm(h, (512,)) * g[:, None] + b[:, None],
        ),
        "conv2d 8ch 32x32": (
            lambda: [F.conv2d(img[:, 8 * i : 8 * i + 8], k[8 * i : 8 * i + 8], padding=1) for i in range(N)],
            lambda: F.conv2d(img, k, padding=1, groups=N),
        ),
        "embedding 256 of 1000x64": (
            lambda: [F.embedding(idx[i], table[i]) for i in range(N)],
            lambda: F.embedding(idx + offsets, table.view(-1, 64)),
        ),
    }


def ratio(loop: Fn, wide: Fn, clock: str, budget: float) -> Tuple[float, float, float, float]:
    """(speedup, low, high, blocked fraction or nan) of one paired measurement."""
    config = TimingConfig(budget_s=budget, target_rel_ci=0.005, clock=clock)
    timed = measure_paired({"loop": loop, "wide": wide}, config=config)
    speedup, low, high = paired_ratio(timed.stats["loop"].samples_ms, timed.stats["wide"].samples_ms, 0.95)
    blocked = timed.health.blocked
    return speedup, low, high, float("nan") if blocked is None else blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=2, help="processes keeping a CPU busy in the loaded runs")
    parser.add_argument("--budget", type=float, default=1.5, help="seconds per function and measurement")
    parser.add_argument("--cpu", type=int, default=0, help="the CPU the measuring thread is pinned to")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {args.cpu})
    cases = pairs()
    conditions = ("quiet", "loaded", "quiet again")
    found: Dict[Tuple[str, str, str], Tuple[float, float, float, float]] = {}
    for condition in conditions:
        with cpu_burners(args.load if condition == "loaded" else 0):
            for name, (loop, wide) in cases.items():
                for clock in ("wall", "auto"):
                    found[name, clock, condition] = ratio(loop, wide, clock, args.budget)
    rows: List[List[str]] = []
    moved: Dict[str, List[float]] = {"wall": [], "auto": []}
    for name in cases:
        for clock in ("wall", "auto"):
            cells = [found[name, clock, c] for c in conditions]
            quiet = statistics.fmean([cells[0][0], cells[2][0]])
            moved[clock].append(abs(cells[1][0] / quiet - 1))
            rows.append(
                [name, "wall" if clock == "wall" else "CPU"]
                + [f"{s:.3f}x [{lo:.3f}, {hi:.3f}]" for s, lo, hi, _ in cells]
                + [f"{cells[1][0] / quiet - 1:+.1%}", f"{cells[2][0] / cells[0][0] - 1:+.1%}"]
                + ["" if clock == "wall" else f"{max(c[3] for c in cells):.2%}"]
            )
    header = ["pair (N=16)", "clock", *conditions, "moved", "quiet drift", "blocked"]
    print(format_table(header, rows))
    for clock, label in (("wall", "wall"), ("auto", "CPU")):
        print(f"{label} clock: load moved the ratios by {statistics.median(moved[clock]):.1%} (median), "
              f"{max(moved[clock]):.1%} at most")


if __name__ == "__main__":
    main()
