"""Does fusing pay more in training than in inference? The best correct strategy's speedup per mode.

Each op's `ci` sweep is run once per mode (inference, forward, backward, forward_backward,
train_step); every mode is its own interleaved run, so compare speedups (ratios within a
run), not milliseconds across rows. Pin it for quotable numbers:

    taskset -c 1 python scripts/modes.py [--ops gemm,mlp,conv2d,layernorm] [--modes inference,train_step]
"""

from __future__ import annotations

import argparse

import torch

from wide_tessera import TimingConfig, benchmark
from wide_tessera.measurement.modes import MODES
from wide_tessera.reports.text import format_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="gemm,mlp,conv2d,layernorm")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for op in args.ops.split(","):
        for mode in args.modes.split(","):
            # the full sampling budget, not the ci preset's smoke run: the numbers go into the README
            result = benchmark(
                op,
                preset="ci",
                device="cpu",
                mode=mode,
                verbose=False,
                timing=TimingConfig(),
                confirm="none",
                controls=False,
            )
            for p in result.points:
                best = max((s for s in result.strategies if s in p.speedups), key=p.speedups.get, default=None)
                if best is None:
                    rows.append([op, mode, str(p.n), "-", "-", "-", "no correct strategy"])
                    continue
                lo, hi = p.speedup_ci[best]
                bad = [f"{s}: {c.error}" for s, c in p.checks.items() if not c.correct]
                rows.append(
                    [
                        op,
                        mode,
                        str(p.n),
                        f"{p.timings['baseline']:.4g}",
                        best,
                        f"{p.speedups[best]:.2f}x [{lo:.2f}, {hi:.2f}]",
                        "; ".join(bad),
                    ]
                )
    print(f"ci presets, {torch.get_num_threads()} thread(s), {result.environment.device_name}")
    print(format_table(["op", "mode", "N", "loop ms", "best", "speedup [95% CI]", "incorrect"], rows))


if __name__ == "__main__":
    main()
