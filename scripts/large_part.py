"""Where Adam's last line (p -= step_size * m / denom) with a step size per model is faster model by
model than over the wide tensor: optim.optimizers._LARGE_PART.

    python scripts/large_part.py [--device cpu] [--n 8] [--budget 0.3]

Over the wide tensor, torch.mul(m, step_size) builds a temporary the size of the parameter: one
more pass over memory. Model by model, torch's addcdiv_ runs on each model's part: N calls, no
temporary. For each part size, the two are timed by measure_paired (one torch thread on a CPU);
each row is the wide update's time over the per-model one (below 1: the wide update is faster)
with its 95% interval. The threshold lies where the ratio crosses 1.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict

import torch

from wide_tessera.core.stats import paired_ratio
from wide_tessera.measurement.timing import TimingConfig, measure_paired
from wide_tessera.reports.text import format_table

PARTS = (1024, 4096, 8192, 16384, 32768, 65536, 262144)


def _updates(n: int, part: int, device: str) -> Dict[str, Callable[[], None]]:
    """The two forms of p -= step_size * m / denom for N models of `part` elements each."""
    g = torch.Generator().manual_seed(0)
    p, m = (torch.randn(n, part, generator=g).to(device) for _ in range(2))
    denom = torch.rand(n, part, generator=g).add_(0.5).to(device)
    steps = torch.rand(n, 1, generator=g).mul_(1e-3).to(device)
    values = steps.flatten().tolist()

    def wide() -> None:  # optimizers.Adam._update below the threshold
        p.addcdiv_(torch.mul(m, steps), denom, value=-1.0)

    def per_model() -> None:  # Numbers.addcdiv_to, at or above it
        for mine, a, b, value in zip(p, m, denom, values):
            mine.addcdiv_(a, b, value=-value)

    return {"per_model": per_model, "wide": wide}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.3)
    args = parser.parse_args()
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)
    config = TimingConfig(budget_s=args.budget)
    rows = []
    for part in PARTS:
        timings = measure_paired(_updates(args.n, part, args.device), args.device, config)
        per_model, wide = timings.stats["per_model"], timings.stats["wide"]
        ratio, low, high = paired_ratio(wide.samples_ms, per_model.samples_ms)
        interval = f"{ratio:.2f} [{low:.2f}, {high:.2f}]"
        rows.append([str(part), f"{per_model.median_ms:.4f}", f"{wide.median_ms:.4f}", interval])
    print(format_table(["elements a part", "per model ms", "wide ms", "wide / per model"], rows))


if __name__ == "__main__":
    main()
