"""An Optuna sweep of a small model's learning rate, weight decay and dropout, run twice on the same
data: Optuna's plain sequential loop, one trial after another, and wide_tessera's fused study,
which trains each group of trials as one wide model.

    python examples/optuna_sweep.py                     # sizes groups on the first group's own steps (within 10%
                                                        # of the study's time; written to sweep_table.json)
    python examples/optuna_sweep.py --group-size 8      # a size of your own
    python examples/optuna_sweep.py --plot sweep.png    # and draw both studies' best value against time
    python examples/optuna_sweep.py --warm-up --micro-batches 4 --autocast
                                                        # training as people write it: a warm-up chain of a
                                                        # length drawn per trial, gradient accumulation, bfloat16

The data is generated: a noisy nonlinear regression of 32 features. Each trial trains a 3-layer
MLP (hidden 64, dropout) with AdamW and a cosine schedule for --steps steps of batch 64, reports
its mean training loss every 20 steps, and is told its loss on held-out data. Both studies use
TPE with the same seed and a median pruner. The dropout rate is drawn as a float: trials of
different rates share a group, each trial's model dropping at its own rate (widen.rates).
--warm-up: a linear warm-up of a length drawn per trial, then the cosine (torch's SequentialLR,
written for one model); --micro-batches K: each step's batch in K micro-batches (gradient
accumulation); --autocast: forward and loss under torch.autocast to bfloat16.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import optuna
import torch
import torch.nn.functional as F
from torch import nn

from wide_tessera.integrations.optuna import Training, optimize, sequential_objective

FEATURES, HIDDEN, BATCH = 32, 64, 64


class MLP(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 1)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.drop(F.relu(self.fc2(self.drop(F.relu(self.fc1(x)))))))


def data(steps: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(FEATURES, generator=g)

    def target(x: torch.Tensor) -> torch.Tensor:
        return (torch.sin(x @ w / FEATURES**0.5) + 0.1 * torch.randn(x.shape[0], generator=g)).unsqueeze(-1)

    x = torch.randn(steps, BATCH, FEATURES, generator=g)
    held_out = torch.randn(1024, FEATURES, generator=g)
    return x, torch.stack([target(b) for b in x]), held_out, target(held_out)


def suggest(trial: Any) -> Dict[str, Any]:
    return {
        "lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 1e-5, 1e-1, log=True),
        "dropout": trial.suggest_float("dropout", 0.0, 0.3),
    }


def suggest_warm_up(trial: Any) -> Dict[str, Any]:
    return {**suggest(trial), "warm_up": trial.suggest_int("warm_up", 1, 20)}


def warm_up_then_cosine(steps: int) -> Callable[[torch.optim.Optimizer, Dict[str, Any]], Any]:
    """One trial's schedule, as one writes it for one model: a linear warm-up of the trial's length,
    then a cosine to 0."""

    def schedule(optimizer: torch.optim.Optimizer, params: Dict[str, Any]) -> Any:
        warm = params["warm_up"]
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [
            torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=warm),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps - warm)], milestones=[warm])  # fmt: skip

    return schedule


def best_over_time(study: optuna.Study, start: float) -> List[Tuple[float, float]]:
    """(seconds since the study began, best value so far) at each trial's completion."""
    done = sorted(
        (t.datetime_complete.timestamp() - start, t.value)
        for t in study.trials
        if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None
    )
    best, out = float("inf"), []
    for when, value in done:
        best = min(best, value)
        out.append((when, best))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--group-size", type=int, default=None, help="trials per group (default: measured)")
    parser.add_argument("--table", type=Path, default=Path("sweep_table.json"), help="the dispatch table it reads")
    parser.add_argument("--sizing-share", type=float, default=0.1, help="most of the study's time spent sizing")
    parser.add_argument("--plot", type=Path, default=None, help="draw both studies' best value against time")
    parser.add_argument("--warm-up", action="store_true", help="a warm-up of a length drawn per trial, then the cosine")
    parser.add_argument("--micro-batches", type=int, default=1, help="each step's batch in K micro-batches")
    parser.add_argument("--autocast", action="store_true", help="forward and loss under autocast to bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    x, y, held_x, held_y = data(args.steps)

    def evaluate(model: nn.Module, params: Dict[str, Any]) -> float:
        with torch.no_grad():
            return float(F.mse_loss(model.eval()(held_x), held_y))

    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.autocast else None
    training = Training(
        steps=args.steps, batch=lambda params, step: (x[step], y[step]), loss=F.mse_loss, optimizer="adamw",
        cosine=not args.warm_up, schedule=warm_up_then_cosine(args.steps) if args.warm_up else None,
        report_every=20, evaluate=evaluate, micro_batches=args.micro_batches, context=autocast,
    )  # fmt: skip
    drawn = suggest_warm_up if args.warm_up else suggest

    def build(params: Dict[str, Any]) -> nn.Module:
        return MLP(params["dropout"])

    def create() -> optuna.Study:
        return optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0), pruner=optuna.pruners.MedianPruner())

    # Both once, untimed, on a trial of a few steps: the first study a process runs pays torch's lazy
    # set-up, which timed cold made the sequential study 1.5x slower (scripts/sweep_speed.py)
    warm = Training(steps=3, batch=training.batch, loss=training.loss, optimizer="adamw", report_every=3)
    create().optimize(sequential_objective(suggest, build, warm), n_trials=1)
    optimize(create(), suggest, build, warm, n_trials=2, group_size=2, strategy="vmap", progress=False)
    began = time.time()
    sequential = create()
    sequential.optimize(sequential_objective(drawn, build, training), n_trials=args.trials)
    sequential_s, sequential_curve = time.time() - began, best_over_time(sequential, began)
    began = time.time()
    fused = create()
    summary = optimize(fused, drawn, build, training, n_trials=args.trials, group_size=args.group_size,
                       table=args.table, sizing_share=args.sizing_share)  # fmt: skip
    fused_s, fused_curve = time.time() - began, best_over_time(fused, began)
    print(summary)
    print(f"\n{'study':<12}{'wall s':>8}{'best held-out MSE':>20}  best trial's parameters")
    for name, study, seconds in (("sequential", sequential, sequential_s), ("fused", fused, fused_s)):
        print(f"{name:<12}{seconds:>8.1f}{study.best_value:>20.4f}  {study.best_params}")
    print(f"the fused study took {fused_s / sequential_s:.2f}x the sequential one's time", end="")
    print(f", {summary.sizing_s:.1f} s of it sizing ({summary.sizing_s / fused_s:.0%})")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, curve in (("Optuna's sequential loop", sequential_curve), ("wide_tessera, fused", fused_curve)):
            ax.step([t for t, _ in curve], [v for _, v in curve], where="post", label=name, marker="o", markersize=3)
        ax.set(xlabel="seconds since the study began", ylabel="best held-out MSE so far", yscale="log", xlim=(0, None))
        ax.set_title(f"{args.trials} trials, {args.steps} steps each, {torch.get_num_threads()} thread")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
