"""Is the `surgery` strategy at least as fast as `vmap` on whole models?

The issue's case: a 2-layer MLP expert (Linear d->hidden, GELU, Linear hidden->d; d=64,
hidden=128, batch 32), N copies, float32, on the CPU with one thread. Both strategies and
the N separate calls are timed in one interleaved benchmark_custom run, so each ratio
surgery/vmap comes with its 95% CI over the paired rounds. Target: surgery at least as
fast as vmap at every N. Pin it for quotable numbers:

    taskset -c 1 python scripts/surgery.py [--n-values 4,16,64] [--d 64] [--hidden 128] [--batch 32]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from wide_tessera import benchmark_custom
from wide_tessera.bench.analysis import speedup_ci
from wide_tessera.bench.report import format_table


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = benchmark_custom(
        MLP, (args.batch, args.d), [int(n) for n in args.n_values.split(",")], d=args.d, hidden=args.hidden, verbose=False
    )
    rows = []
    for p in result.points:
        if "surgery" not in p.stats or "vmap" not in p.stats:
            rows.append([str(p.n), "-", "-", "-", "-", "no timing: " + "; ".join(map(str, p.failures.values()))])
            continue
        lo, hi = speedup_ci(p.stats["vmap"].samples_ms, p.stats["surgery"].samples_ms)
        ratio = p.timings["vmap"] / p.timings["surgery"]
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
    print(f"MLP d={args.d} hidden={args.hidden} batch={args.batch}, {torch.get_num_threads()} thread(s), {result.environment.device_name}")
    print(format_table(["N", "loop ms", "vmap ms", "surgery ms", "vmap/surgery [95% CI]", "verdict"], rows))
    print(result.summary().splitlines()[0])


if __name__ == "__main__":
    main()
