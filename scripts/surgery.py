"""Is the `surgery` strategy at least as fast as `vmap` on whole models?

The issue's case: a 2-layer MLP expert (Linear d->hidden, GELU, Linear hidden->d; d=64,
hidden=128, batch 32), N copies, float32, on the CPU with one thread. Both strategies and
the N separate calls are timed in one interleaved benchmark_custom run, so each ratio
surgery/vmap comes with its 95% CI over the paired rounds. Target: surgery at least as
fast as vmap at every N. Pin it for quotable numbers:

    taskset -c 1 python scripts/surgery.py [--n-values 4,16,64] [--d 64] [--hidden 128] [--batch 32]

With --widecompiler DIR (a checkout of github.com/AbstractEyes/pytorch-parallel-compiler,
whose `wide_compiler.compile` traces a model and swaps each layer for its wide version),
the same N models also go through WideCompiler; its outputs are checked against the N
calls and its forward is timed in one interleaved run with surgery's, each on its own
packed input (packing is outside the timed call on both sides, as in benchmark_custom).
Target: surgery at least as fast as WideCompiler's traced model.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from functools import partial
from typing import List

import torch
from torch import nn

from wide_tessera import benchmark_custom
from wide_tessera.core.correctness import check_outputs, tolerance
from wide_tessera.core.stats import paired_ratio
from wide_tessera.measurement.timing import measure_paired
from wide_tessera.reports.text import format_table
from wide_tessera.widen.surgery import WideSurgery


class MLP(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 128):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-values", default="4,16,64")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--widecompiler", metavar="DIR", help="also time WideCompiler's traced model from this checkout"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n_values = [int(n) for n in args.n_values.split(",")]
    result = benchmark_custom(
        MLP, (args.batch, args.d), n_values, model_kwargs=dict(d=args.d, hidden=args.hidden), verbose=False
    )
    rows = []
    for p in result.points:
        if "surgery" not in p.stats or "vmap" not in p.stats:
            rows.append([str(p.n), "-", "-", "-", "-", "no timing: " + "; ".join(map(str, p.failures.values()))])
            continue
        ratio, lo, hi = paired_ratio(p.stats["vmap"].samples_ms, p.stats["surgery"].samples_ms)
        verdict = "surgery faster" if lo > 1 else "vmap faster" if hi < 1 else "tie"
        rows.append(
            [
                str(p.n),
                f"{p.timings['baseline']:.4g}",
                f"{p.timings['vmap']:.4g}",
                f"{p.timings['surgery']:.4g}",
                f"{ratio:.2f}x [{lo:.2f}, {hi:.2f}]",
                verdict,
            ]
        )
    print(
        f"MLP d={args.d} hidden={args.hidden} batch={args.batch}, {torch.get_num_threads()} thread(s), "
        f"{result.environment.device_name}"
    )
    print(format_table(["N", "loop ms", "vmap ms", "surgery ms", "vmap/surgery [95% CI]", "verdict"], rows))
    print(result.summary().splitlines()[0])
    if args.widecompiler:
        against_widecompiler(args, n_values)


def against_widecompiler(args: argparse.Namespace, n_values: List[int]) -> None:
    """surgery against WideCompiler's traced model on the same N models, one interleaved run per N."""
    sys.path.insert(0, args.widecompiler)
    wide_compiler = importlib.import_module("wide_compiler")
    rows, tol = [], tolerance(torch.float32, "cpu")
    for n in n_values:
        torch.manual_seed(0)
        models = [MLP(args.d, args.hidden) for _ in range(n)]
        inputs = [torch.randn(args.batch, args.d) for _ in range(n)]
        with torch.no_grad():
            expected = [m(x) for m, x in zip(models, inputs)]
            ours = WideSurgery(models)
            theirs = wide_compiler.compile(models, inputs[0][:1], compile_model=False, debug=False)
            x_ours, x_theirs = ours.pack(inputs), wide_compiler.pack(inputs)
            checks = {
                "surgery": check_outputs(ours.unpack(ours(x_ours)), expected, tol),
                "widecompiler": check_outputs(wide_compiler.unpack(theirs(x_theirs), n), expected, tol),
            }
            stats = measure_paired({"surgery": partial(ours, x_ours), "widecompiler": partial(theirs, x_theirs)}).stats
        ratio, lo, hi = paired_ratio(stats["widecompiler"].samples_ms, stats["surgery"].samples_ms)
        verdict = "surgery faster" if lo > 1 else "widecompiler faster" if hi < 1 else "tie"
        rows.append(
            [
                str(n),
                f"{stats['surgery'].median_ms:.4g}",
                f"{stats['widecompiler'].median_ms:.4g}",
                f"{ratio:.2f}x [{lo:.2f}, {hi:.2f}]",
                verdict,
            ]
            + [f"{c.max_rel_error:.1e}" if c.correct else f"WRONG: {c.error}" for c in checks.values()]
        )
    print(
        f"WideCompiler {getattr(wide_compiler, '__version__', '(no version)')} from {args.widecompiler}, eager "
        "(compile_model=False)"
    )
    print(
        format_table(
            [
                "N",
                "surgery ms",
                "widecompiler ms",
                "widecompiler/surgery [95% CI]",
                "verdict",
                "surgery rel. error",
                "widecompiler rel. error",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
