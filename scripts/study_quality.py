"""A study the integration was not tuned on, fused against Optuna's sequential loop, over several
sampler seeds: wall time, sizing's share of it, and the best value each study reached by the time
the other was done.

Each trial trains a small conv net (Conv2d 3->8, BatchNorm, ReLU, Conv2d 8->16 stride 2,
BatchNorm, ReLU, average pool, dropout, Linear 16->10) on generated 16x16 images (each its
class's random pattern plus noise of the same size), with AdamW for --steps steps of batch 32;
lr, weight decay and a dropout rate drawn as a float are suggested by TPE (`constant_liar=True`,
which gives trials asked while their group mates run something to lie about), and a
successive-halving pruner stops trials every 10 steps. The value told is the held-out
cross-entropy. Per seed, the sequential study (`sequential_objective` under `study.optimize`,
torch's own AdamW) and the fused study (`optimize`, with an empty dispatch table of its own, so
it sizes its groups within `--sizing-share` of its estimated sequential time) run back to back,
each from a fresh study.

Columns: each study's wall time; fused/sequential speed (>1: the fused study was faster);
sizing's seconds and its share of the fused study; each study's best value at the moment the
earlier of the two ended ("at par time"), and which was at least as good there; each study's
best value at its own end, which is the sampler's view alone, whatever the speed. Then, over the
trials both studies asked with the same parameters (TPE's first random trials), the largest
relative difference of their values: with dropout on, a group draws its masks together, so
these agree in distribution, not to rounding (docs/sweeps.md); `--dropout-off` draws no
dropout, where they should agree to a fused forward's rounding.

Targets (issue 64): fused at least 1.5x quiet and 1.2x beside one busy process, sizing at most
10% of the fused study, and at least as good at par time in at least 4 of 5 seeds. Pin it or
load it and say which:

    taskset -c 1 python scripts/study_quality.py [--seeds 5] [--trials 24] [--steps 100] [--dropout-off]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import optuna
import torch
import torch.nn.functional as F
from torch import nn

from wide_tessera.integrations.optuna import Training, optimize, sequential_objective
from wide_tessera.reports.text import format_table

BATCH, SIDE, CLASSES = 32, 16, 10


class ConvNet(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x)))


def data(steps: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images and their classes: `steps` training batches and 512 held-out images."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(CLASSES, 3, SIDE, SIDE, generator=g)
    labels = torch.randint(CLASSES, (steps * BATCH + 512,), generator=g)
    images = patterns[labels] + torch.randn(len(labels), 3, SIDE, SIDE, generator=g)
    x, y = images[: steps * BATCH], labels[: steps * BATCH]
    return x.view(steps, BATCH, 3, SIDE, SIDE), y.view(steps, BATCH), images[steps * BATCH :], labels[steps * BATCH :]


def best_at(study: optuna.Study, start: float, until: float) -> float:
    """The best value among the trials completed within `until` seconds of `start` (inf: none)."""
    done = [
        t.value
        for t in study.trials
        if t.state == optuna.trial.TrialState.COMPLETE
        and t.value is not None
        and t.datetime_complete.timestamp() - start <= until
    ]
    return min(done, default=math.inf)


def same_trials_gap(a: optuna.Study, b: optuna.Study) -> Tuple[int, float]:
    """How many completed trials of `a` have a completed twin in `b` (the same parameters), and
    the largest relative difference of their values."""
    values = {tuple(sorted(t.params.items())): t.value for t in b.trials if t.state.name == "COMPLETE"}
    gaps = [
        abs(t.value - values[key]) / max(abs(values[key]), 1e-12)
        for t in a.trials
        if t.state.name == "COMPLETE" and (key := tuple(sorted(t.params.items()))) in values
    ]
    return len(gaps), max(gaps, default=math.nan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sizing-share", type=float, default=0.1)
    parser.add_argument("--dropout-off", action="store_true", help="suggest no dropout (values comparable to rounding)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    x, y, held_x, held_y = data(args.steps)

    def suggest(trial: Any) -> Dict[str, Any]:
        return {
            "lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 1e-5, 1e-1, log=True),
            "dropout": 0.0 if args.dropout_off else trial.suggest_float("dropout", 0.0, 0.5),
        }

    def evaluate(model: nn.Module, params: Dict[str, Any]) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model.eval()(held_x), held_y))

    training = Training(
        steps=args.steps, batch=lambda params, step: (x[step], y[step]), loss=F.cross_entropy,
        optimizer="adamw", report_every=10, evaluate=evaluate,
    )  # fmt: skip

    def build(params: Dict[str, Any]) -> nn.Module:
        return ConvNet(params["dropout"])

    def create(seed: int) -> optuna.Study:
        sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
        return optuna.create_study(sampler=sampler, pruner=optuna.pruners.SuccessiveHalvingPruner())

    # Both once, untimed: the first study a process runs pays torch's lazy set-up
    warm = Training(steps=3, batch=training.batch, loss=training.loss, optimizer="adamw", report_every=3)
    create(0).optimize(sequential_objective(suggest, build, warm), n_trials=1)
    optimize(create(0), suggest, build, warm, n_trials=2, group_size=2, strategy="vmap", progress=False)

    rows: List[List[str]] = []
    at_least_as_good = at_end = 0
    for seed in range(args.seeds):
        began = time.time()
        sequential = create(seed)
        sequential.optimize(sequential_objective(suggest, build, training), n_trials=args.trials)
        sequential_s = time.time() - began
        with tempfile.TemporaryDirectory() as empty:  # every seed's fused study starts with an empty table
            fused_began = time.time()
            fused = create(seed)
            summary = optimize(fused, suggest, build, training, n_trials=args.trials, progress=False,
                               table=Path(empty) / "table.json", sizing_share=args.sizing_share)  # fmt: skip
            fused_s = time.time() - fused_began
        par = min(sequential_s, fused_s)
        seq_best, fused_best = best_at(sequential, began, par), best_at(fused, fused_began, par)
        at_least_as_good += fused_best <= seq_best
        twins, gap = same_trials_gap(fused, sequential)
        pruned = [sum(t.state.name == "PRUNED" for t in s.trials) for s in (sequential, fused)]
        ends = [best_at(s, start, math.inf) for s, start in ((sequential, began), (fused, fused_began))]
        at_end += ends[1] <= ends[0]
        rows.append([
            str(seed), f"{sequential_s:.1f}", f"{fused_s:.1f}", f"{sequential_s / fused_s:.2f}x",
            f"{summary.sizing_s:.1f} ({summary.sizing_s / fused_s:.0%})", f"{seq_best:.4f}", f"{fused_best:.4f}",
            "fused" if fused_best <= seq_best else "sequential", f"{ends[0]:.4f} / {ends[1]:.4f}",
            f"{pruned[0]} / {pruned[1]}", f"{twins}: {gap:.1e}",
        ])  # fmt: skip
        print(summary, flush=True)
    print(format_table(
        ["seed", "sequential s", "fused s", "speed", "sizing s", "seq. best at par", "fused best at par",
         "at least as good", "best at the end (seq / fused)", "pruned (seq / fused)", "twin trials: max rel. diff"],
        rows,
    ))  # fmt: skip
    print(f"fused at least as good at par time in {at_least_as_good} of {args.seeds} seeds, at the end of both "
          f"studies in {at_end}; "
          f"{torch.get_num_threads()} torch thread")  # fmt: skip


if __name__ == "__main__":
    main()
