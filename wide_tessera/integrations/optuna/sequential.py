"""The sequential study a fused one is compared with: one trial at a time, torch's own optimizer,
clipping and schedule."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...core import trees
from ...core.seeding import seeded
from .host import optuna
from .training import Training, loss_of, on_device
from .trial import Draws, build_model, suggested, trial_seed


def sequential_objective(
    suggest: Callable[[Any], Dict[str, Any]],
    build: Callable[[Dict[str, Any]], nn.Module],
    training: Training,
    device: str = "cpu",
) -> Callable[[Any], float]:
    """An Optuna objective that trains one trial alone, with torch's own optimizer, clipping and
    schedule, reporting and pruning as `optimize` does: the sequential study a fused one is
    compared with (`study.optimize(sequential_objective(...), n_trials=16)`)."""

    def objective(trial: Any) -> float:
        params = suggested(suggest, trial)
        model = build_model(build, trial, params, device).to(device)
        draws = Draws(trial_seed(trial, params), device)
        with seeded(draws.training_seed, device):  # its dropout masks
            return train_alone(trial, params, model, draws, training, device)

    return objective


def train_alone(
    trial: Any, params: Dict[str, Any], model: nn.Module, draws: Draws, training: Training, device: str,
    tick: Callable[[], None] = lambda: None, resume: Optional[Tuple[int, Dict[str, Any], List[float]]] = None,
) -> float:  # fmt: skip
    """One trial trained alone with torch's own optimizer, clipping and schedule, reporting each
    mean loss and raising optuna.TrialPruned where the pruner says so: the sequential loop's
    training, and a group of one's (`tick`: after each step, for a progress bar). `resume`: go on
    from a step (its optimizer's torch state, its losses so far), where a group left it."""
    model.train()
    after_backward = training.alone_step(model, params)
    first, losses = 0, []
    if resume is not None:
        first, state, losses = resume[0], resume[1], list(resume[2])
        after_backward.optimizers[0].load_state_dict(state)
        after_backward.restart_schedules(first - 1)  # `first` steps taken
    value = training.reported(losses) if losses else math.nan
    for step in range(first, training.steps):
        x, y = on_device(device, draws.batch(training, params, step))
        loss = loss_of(training, trees.call(model, x), y)
        torch.autograd.backward(loss)
        after_backward()
        losses.append(float(loss.detach()))
        tick()
        if training.reports_at(step):
            value = training.reported(losses)
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
    return training.evaluate(model, params) if training.evaluate is not None else value
