"""A mixture-of-experts layer whose experts go through `wide_tessera.fuse`: fused where this
machine's measurements say fusing wins at this N, a plain loop where they do not.

    python examples/moe.py                 # tunes what it needs into moe_table.json first (minutes), then times
    python examples/moe.py --table T.json  # another table (tuned into if it lacks the entries)

It prints, for N = 4, 16 and 64 experts, what `fuse` decided and why, and the layer's forward
time with `fuse` against the same layer with a plain loop over its experts (same router, same
weights, outputs compared), timed in interleaved rounds by wide_tessera's own timer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

import wide_tessera as wt
from wide_tessera.core.stats import paired_ratio
from wide_tessera.measurement.timing import TimingConfig, measure_paired
from wide_tessera.ops import Expert

D_MODEL, HIDDEN, TOKENS = 128, 256, 1024  # one batch of 1024 tokens, split among the experts
N_VALUES = (4, 16, 64)


class MoE(nn.Module):
    """Top-1 routing: each token goes to its highest-scoring expert, its output scaled by that score.

    `experts` is what `wt.fuse` returned, fused or a loop: pack the routed groups,
    call, unpack, whichever it is.
    """

    def __init__(self, router: nn.Linear, experts: nn.Module):
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, d_model]
        score, expert = self.router(x).softmax(-1).max(-1)
        order = expert.argsort()
        counts = torch.bincount(expert, minlength=self.router.out_features).tolist()
        groups = list(x[order].split(counts))
        outputs = self.experts.unpack(self.experts(self.experts.pack(groups)))
        y = torch.empty_like(x)
        y[order] = torch.cat(outputs) * score[order, None]
        return y


def tune(table: Path) -> None:
    """The entries this example needs: tokens per expert 1024/N, routing uniform and skewed."""
    tokens = ",".join(str(TOKENS // n) for n in N_VALUES)
    command = [
        sys.executable, "-m", "wide_tessera", "tune", "moe_experts", "--preset", "quick", "--device", "cpu",
        "--set", f"tokens={tokens}", "--set", f"d_model={D_MODEL}", "--set", f"hidden={HIDDEN}",
        "--set", "skew=0.0,1.0", "--set", "dtype=float32", "--n-values", "1,4,16,64", "-o", str(table), "--quiet",
    ]  # fmt: skip
    print("tuning:", " ".join(command[1:]), file=sys.stderr)
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=Path("moe_table.json"))
    parser.add_argument("--budget", type=float, default=1.0, help="sampling seconds per layer and N")
    args = parser.parse_args()
    if not args.table.exists() or not any(e.op == "moe_experts" for e in wt.DispatchTable.load(args.table).entries):
        tune(args.table)
    torch.manual_seed(0)
    rows = []
    for n in N_VALUES:
        router = nn.Linear(D_MODEL, n)
        experts = [Expert(D_MODEL, HIDDEN) for _ in range(n)]
        # The routing's skew tells the tuned entries apart. This fresh router on random tokens
        # gives its largest group 1.05x, 1.5x and 2.1x the mean at N = 4, 16, 64: near uniform
        # (skew 0.0), far from skew 1.0 (1.9x, 4.7x, 13.5x); a trained router may need skew=1.0.
        fused = wt.fuse(experts, table=args.table, op="moe_experts", tokens=TOKENS // n, skew=0.0)
        print(f"N={n}: {fused.decision}\n")
        looped = wt.fuse(experts, op="moe_experts", strategy="loop")
        with_fuse, with_loop = MoE(router, fused).eval(), MoE(router, looped).eval()
        x = torch.randn(TOKENS, D_MODEL)
        with torch.no_grad():
            error = ((with_fuse(x) - with_loop(x)).norm() / with_loop(x).norm()).item()
            timed = measure_paired(
                {"loop": partial(with_loop, x), "fuse": partial(with_fuse, x)},
                "cpu",
                TimingConfig(budget_s=args.budget),
            )
        loop, fuse = timed.stats["loop"], timed.stats["fuse"]
        ratio, low, high = paired_ratio(loop.samples_ms, fuse.samples_ms)  # the interval the runner decides on
        what = fused.decision.strategy if fused.decision.fused else "loop"
        speed = f"{ratio:.2f}x [{low:.2f}, {high:.2f}]"
        rows.append(
            f"{n:<4}{TOKENS // n:<8}{what:<12}{loop.median_ms:<10.3f}{fuse.median_ms:<10.3f}{speed:<22}{error:.1e}"
        )
    print(f"MoE layer, {TOKENS} tokens, d_model={D_MODEL}, hidden={HIDDEN}, {torch.get_num_threads()} threads")
    print(f"{'N':<4}{'tokens':<8}{'fuse()':<12}{'loop ms':<10}{'fuse ms':<10}{'speedup [95% CI]':<22}rel. error")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
