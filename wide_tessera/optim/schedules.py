"""Learning-rate schedules with their own numbers for each of the N models.

wide_tessera.optim's optimizers keep model i's settings in `param_groups[i]`, so any torch
scheduler already schedules each model from its own learning rate (StepLR(opt, 10) decays all N
every 10 steps, each from its own), and torch's LambdaLR with a list of N functions gives each
its own schedule. These take one value or N for every argument: a sweep over the schedule itself.
Each is a LambdaLR (torch's bookkeeping, state_dict and chaining with SequentialLR included),
its factor the closed form of torch's scheduler of the same name.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, List

import torch

from ..core.errors import WideTesseraError
from .per_model import number, per_model

__all__ = ["StepLR", "CosineAnnealingLR", "LinearLR"]


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WideTesseraError(f"{name}={value!r}: give a positive int")
    return value


def _step_factor(step_size: int, gamma: float, epoch: int) -> float:
    return gamma ** (epoch // step_size)


def _cosine_factor(t_max: int, floor: float, epoch: int) -> float:
    """torch's CosineAnnealingLR in closed form, as a factor of the base lr (`floor`: eta_min / base lr)."""
    return floor + (1 - floor) * (1 + math.cos(math.pi * epoch / t_max)) / 2


def _linear_factor(start: float, end: float, total: int, epoch: int) -> float:
    return start + (end - start) * min(epoch, total) / total


class StepLR(torch.optim.lr_scheduler.LambdaLR):
    """torch's StepLR per model: lr times gamma every step_size steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, step_size: Any, gamma: Any = 0.1, last_epoch: int = -1):
        n = len(optimizer.param_groups)
        sizes = per_model("step_size", step_size, n, _count)
        gammas = per_model("gamma", gamma, n, number(0.0))
        factors: List[Callable[[int], float]] = [partial(_step_factor, s, g) for s, g in zip(sizes, gammas)]
        super().__init__(optimizer, factors, last_epoch)


class CosineAnnealingLR(torch.optim.lr_scheduler.LambdaLR):
    """torch's CosineAnnealingLR per model: from the model's lr down to eta_min over T_max steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, T_max: Any, eta_min: Any = 0.0, last_epoch: int = -1):
        n = len(optimizer.param_groups)
        lengths = per_model("T_max", T_max, n, _count)
        floors = per_model("eta_min", eta_min, n, number(0.0))
        bases = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        factors: List[Callable[[int], float]] = [
            partial(_cosine_factor, t, (f / b if b else 0.0)) for t, f, b in zip(lengths, floors, bases)
        ]
        super().__init__(optimizer, factors, last_epoch)


class LinearLR(torch.optim.lr_scheduler.LambdaLR):
    """torch's LinearLR per model (a linear warm-up): lr times a factor going from start_factor to
    end_factor over total_iters steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        start_factor: Any = 1.0 / 3,
        end_factor: Any = 1.0,
        total_iters: Any = 5,
        last_epoch: int = -1,
    ):
        n = len(optimizer.param_groups)
        starts = per_model("start_factor", start_factor, n, number(0.0, 1.0))
        ends = per_model("end_factor", end_factor, n, number(0.0, 1.0))
        totals = per_model("total_iters", total_iters, n, _count)
        factors: List[Callable[[int], float]] = [
            partial(_linear_factor, s, e, t) for s, e, t in zip(starts, ends, totals)
        ]
        super().__init__(optimizer, factors, last_epoch)
