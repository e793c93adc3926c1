"""An Optuna sweep of PEFT-wrapped trials, fused against Optuna's sequential loop: wall time and
how far each trial's value is from the one it reaches alone.

Each trial is `peft.get_peft_model` over one frozen base (Linear h->h, ReLU, Linear h->h; a LoRA
adapter of rank 8 on both), its learning rate and lora_alpha suggested by a RandomSampler of one
seed (the same trials in both studies), trained by AdamW for --steps steps of one batch of 32
(no dropout, so a fused trial's value is its alone value to a fused forward's rounding). The
sequential study runs `sequential_objective` under `study.optimize`; the fused one
`optimize(...)`, the 16 trials in one group of each strategy, then sized as a user who names no
group size gets it (an empty dispatch table: the first group probes on its own steps, within 10%
of the study's time). Pin it or load it and say which:

    taskset -c 1 python scripts/peft_sweep.py [--hidden 256] [--steps 50]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import optuna
import peft
import torch
import torch.nn.functional as F
from torch import nn

from wide_tessera.integrations.optuna import Training, optimize, sequential_objective
from wide_tessera.reports.text import format_table

TRIALS, BATCH = 16, 32


def suggest(trial: Any) -> Dict[str, Any]:
    return {"lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True), "alpha": trial.suggest_float("alpha", 1.0, 64.0)}


def timed(run: Callable[[optuna.Study], Any]) -> Tuple[float, List[float], Any]:
    """The study's wall time, its trials' values, and what `run` returned."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.NopPruner())
    start = time.perf_counter()
    returned = run(study)
    return time.perf_counter() - start, [t.value for t in study.trials], returned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.manual_seed(0)
    h = args.hidden
    base = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h)).requires_grad_(False)
    x = torch.randn(args.steps, BATCH, h)
    y = torch.sin(x @ torch.randn(h, h) / h**0.5)

    def build(params: Dict[str, Any]) -> nn.Module:
        config = peft.LoraConfig(r=8, lora_alpha=params["alpha"], target_modules=["0", "2"])
        return peft.get_peft_model(copy.deepcopy(base), config)

    training = Training(steps=args.steps, batch=lambda params, step: (x[step], y[step]), loss=F.mse_loss,
                        optimizer="adamw", report_every=10)  # fmt: skip
    objective = sequential_objective(suggest, build, training)
    sequential_s, alone, _ = timed(lambda s: s.optimize(objective, n_trials=TRIALS))
    rows = [["sequential", f"{sequential_s:.2f}", "1.00x", "one at a time", "-"]]
    with tempfile.TemporaryDirectory() as empty:
        table = str(Path(empty) / "dispatch.json")  # the sized study's own, empty at its start
        for strategy in ("vmap", "surgery", None):
            size = TRIALS if strategy else None
            seconds, values, summary = timed(
                partial(optimize, suggest=suggest, build=build, training=training, n_trials=TRIALS, group_size=size,
                        strategy=strategy, table=table, progress=False)  # fmt: skip
            )
            rows.append(row(strategy or "sized (empty table)", seconds, sequential_s, summary, values, alone))
    print(f"{TRIALS} PEFT LoRA trials (rank 8 on two Linear {h}x{h}, batch {BATCH}, {args.steps} steps), "
          f"{torch.get_num_threads()} thread(s)")  # fmt: skip
    print(format_table(["study", "wall s", "speed", "groups (trials, strategy)", "worst value rel. diff"], rows))
    print(f"sized: {summary}")


def row(
    name: str, seconds: float, sequential_s: float, summary: Any, values: List[float], alone: List[float]
) -> List[str]:
    """A fused study's row: its time, its speed against the sequential one, its groups, and the
    largest relative difference of a trial's value from the value it reached alone."""
    groups = " ".join(f"{len(g.trials)} {g.strategy or 'loop'}" for g in summary.groups)
    worst = max(abs(a - b) / abs(b) for a, b in zip(values, alone))
    return [name, f"{seconds:.2f}", f"{sequential_s / seconds:.2f}x", groups, f"{worst:.1e}"]


if __name__ == "__main__":
    main()
