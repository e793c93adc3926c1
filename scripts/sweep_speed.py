"""A fused Optuna study against Optuna's sequential loop: the same trials, their final losses, the
best trial, and the wall time of each.

16 trials of a 3-layer MLP (Linear h->h, ReLU, Linear h->h, ReLU, Linear h->1), lr and weight
decay suggested by a RandomSampler of one seed (the same trials whatever was told before),
AdamW for --steps steps on generated data. The sequential study runs
`wide_tessera.integrations.optuna.sequential_objective` (torch's own optimizer, one trial at a
time) under `study.optimize`; the fused one `optimize(...)`, all 16 trials in one group of
--strategy. Then again with a MedianPruner (4 trials a group, so that later groups can be
pruned against finished ones), to see pruned trials stop costing time. With --table T, the
fused study sizes its groups and picks its strategy as it does by default, from the dispatch
table T (a first, untimed study measures what T lacks). Without a pruner, the sequential study
runs again from weights moved by one unit of rounding: its final losses' distance from the first
is how far these trainings carry a difference as small as a fused forward's other summation
order, the floor for "final loss rel. diff". Pin it:

    taskset -c 1 python scripts/sweep_speed.py [--hidden 64,256] [--batch 64,256] [--steps 200] [--table T]
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, Optional, Tuple

import optuna
import torch
import torch.nn.functional as F
from torch import nn

from wide_tessera.integrations.optuna import Training, optimize, sequential_objective
from wide_tessera.reports.text import format_table

TRIALS = 16


def suggest(trial: Any) -> Dict[str, Any]:
    return {
        "lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1),
    }


def run(
    hidden: int, batch: int, steps: int, strategy: Optional[str], pruner: Any, group: Optional[int],
    table: Optional[str] = None, twin: bool = False, verbose: bool = False,
) -> Tuple[Any, ...]:  # fmt: skip
    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    g = torch.Generator().manual_seed(0)
    w = torch.randn(hidden, 1, generator=g)
    x = torch.randn(steps, batch, hidden, generator=g)
    y = torch.sin(x @ w / hidden**0.5)
    training = Training(
        steps=steps, batch=lambda p, s: (x[s], y[s]), loss=F.mse_loss, optimizer="adamw", report_every=20
    )

    def nudged(params: Dict[str, Any]) -> nn.Module:
        """The trial's model, each weight moved by one unit of rounding (random signs): how far the
        training carries a difference as small as another summation order makes."""
        model = MLP()
        signs = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for t in model.parameters():
                t.add_((torch.randint(0, 2, t.shape, generator=signs) * 2 - 1) * t.abs() * torch.finfo(t.dtype).eps)
        return model

    def create() -> optuna.Study:
        return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), pruner=pruner())

    if table is not None:  # the table learns what it lacks, untimed
        optimize(create(), suggest, lambda p: MLP(), training, n_trials=TRIALS, table=table, progress=False)
    # Both sides once, untimed: the first study a process runs pays torch's lazy set-up, which made the
    # sequential study, timed first, 1.5x slower at hidden 64 (3.2 s against 2.0 s after a warm-up)
    create().optimize(sequential_objective(suggest, lambda p: MLP(), training), n_trials=2)
    optimize(create(), suggest, lambda p: MLP(), training, n_trials=2, group_size=2, strategy=strategy or "vmap",
             table=table, progress=False)  # fmt: skip
    begin = time.perf_counter()
    sequential = create()
    sequential.optimize(sequential_objective(suggest, lambda p: MLP(), training), n_trials=TRIALS)
    sequential_s = time.perf_counter() - begin
    begin = time.perf_counter()
    fused = create()
    summary = optimize(fused, suggest, lambda p: MLP(), training, n_trials=TRIALS, group_size=group,
                       strategy=strategy, table=table, progress=False)  # fmt: skip
    if verbose or table is not None:
        print(summary)
    fused_s = time.perf_counter() - begin
    complete = optuna.trial.TrialState.COMPLETE

    def worst_of(one: optuna.Study, other: optuna.Study) -> float:
        done = [(a, b) for a, b in zip(one.trials, other.trials) if a.state == b.state == complete]
        return max(abs(a.value - b.value) / abs(a.value) for a, b in done)

    worst = worst_of(sequential, fused)
    twin_worst = None
    if twin:
        rounded = create()
        rounded.optimize(sequential_objective(suggest, nudged, training), n_trials=TRIALS)
        twin_worst = worst_of(sequential, rounded)
    if verbose:
        for a, b in zip(sequential.trials, fused.trials):
            print(a.number, a.params, a.value, b.value)
    pruned = [sum(t.state == optuna.trial.TrialState.PRUNED for t in s.trials) for s in (sequential, fused)]
    best = (sequential.best_trial.number, fused.best_trial.number)
    return sequential_s, fused_s, worst, twin_worst, best, pruned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="64,256")
    parser.add_argument("--batch", default="64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--strategy", default="surgery")
    parser.add_argument("--table", default=None, help="size groups and pick strategies from this dispatch table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = []
    for hidden, batch in zip(map(int, args.hidden.split(",")), map(int, args.batch.split(","))):
        studies = (("none", optuna.pruners.NopPruner, TRIALS), ("median", optuna.pruners.MedianPruner, 4))
        for name, pruner, group in studies:
            strategy, size = (None, None) if args.table else (args.strategy, group)
            timed = run(hidden, batch, args.steps, strategy, pruner, size, args.table, twin=name == "none")
            sequential_s, fused_s, worst, twin_worst, best, pruned = timed
            rows.append([
                f"{hidden}/{batch}", name, "measured" if args.table else str(group), f"{sequential_s:.2f}",
                f"{fused_s:.2f}",
                f"{sequential_s / fused_s:.2f}x", f"{worst:.1e}", "-" if twin_worst is None else f"{twin_worst:.1e}",
                f"{best[0]} / {best[1]}",
                f"{pruned[0]} / {pruned[1]}",
            ])  # fmt: skip
    how = f"groups and strategies from {args.table}" if args.table else f"fused as {args.strategy}"
    print(f"{TRIALS} trials, {args.steps} steps, AdamW, {how}, {torch.get_num_threads()} thread")
    header = ["hidden/batch", "pruner", "group", "sequential s", "fused s", "speedup", "final loss rel. diff",
              "seq. rounding twin's",
              "best trial seq / fused", "pruned seq / fused"]  # fmt: skip
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
