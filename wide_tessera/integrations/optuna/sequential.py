"""The sequential study a fused one is compared with: one trial at a time, torch's own optimizer,
clipping and schedule."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from torch import nn

from ...core import trees
from ...core.seeding import seeded
from .host import optuna
from .training import Training, forward_backward, on_device
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


class Resume(NamedTuple):
    """Where a group left a trial: the steps taken, its optimizer's and its scheduler's state
    (torch's format; None: no schedule), its losses so far."""

    step: int
    optimizer: Dict[str, Any]
    schedule: Optional[Dict[str, Any]]
    losses: List[float]


def train_alone(
    trial: Any, params: Dict[str, Any], model: nn.Module, draws: Draws, training: Training, device: str,
    tick: Callable[[], None] = lambda: None, resume: Optional[Resume] = None,
) -> float:  # fmt: skip
    """One trial trained alone with torch's own optimizer, clipping and schedule, reporting each
    mean loss and raising optuna.TrialPruned where the pruner says so: the sequential loop's
    training, and a group of one's (`tick`: after each step, for a progress bar). `resume`: go on
    from where a group left it."""
    model.train()
    after_backward = training.alone_step(model, params)
    first, losses = 0, []
    if resume is not None:
        first, losses = resume.step, list(resume.losses)
        after_backward.optimizers[0].load_state_dict(resume.optimizer)  # after the scheduler set its lr
        if resume.schedule is not None:
            after_backward.schedules[0].load_state_dict(resume.schedule)
    value = training.reported(losses) if losses else math.nan
    for step in range(first, training.steps):
        batch = on_device(device, draws.batch(training, params, step))
        losses.append(step_alone(training, model, after_backward, batch))
        tick()
        if training.reports_at(step):
            value = training.reported(losses)
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
    return training.evaluate(model, params) if training.evaluate is not None else value


def step_alone(training: Training, model: nn.Module, after_backward: Callable[[], None], batch: Any) -> float:
    """One training step of one model alone (its forward and backward, then `after_backward`): its loss."""
    failed: Dict[int, Exception] = {}
    losses = forward_backward(training, lambda xs: [trees.call(model, xs[0])], {0: batch}, 1, failed)
    if failed:
        raise failed[0]
    after_backward()
    return losses[0]
