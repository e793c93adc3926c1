"""Learning-rate schedules with their own numbers for each of the N models.

wide_tessera.optim's optimizers keep model i's settings in `param_groups[i]`, so any torch
scheduler already schedules each model from its own learning rate (StepLR(opt, 10) decays all N
every 10 steps, each from its own), and torch's LambdaLR with a list of N functions gives each
its own schedule. These take one value or N for every argument: a sweep over the schedule itself.
Each steps each model's lr as torch's scheduler of the same name steps it: from the lr as it
stands (what ChainedScheduler, or two schedulers stepped each step, multiply), and in closed
form only where torch is (an epoch given to step(); SequentialLR's milestones). As closed-form
LambdaLRs they overwrote the lr: chained with a warm-up, the warm-up was lost (model 0's lr 0.1
where torch's is 0.0325; parameters 0.20 apart after 8 SGD steps).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, List

import torch

from ..core.errors import WideTesseraError
from .per_model import number, per_model

__all__ = ["StepLR", "CosineAnnealingLR", "LinearLR"]


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WideTesseraError(f"{name}={value!r}: give a positive int")
    return value


def _epoch(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < -1:
        raise WideTesseraError(f"{name}={value!r}: give an int from -1 (not started) up")
    return int(value)


Scheduler = torch.optim.lr_scheduler.LRScheduler


def _initial(scheduler: Scheduler) -> bool:
    """Whether this is the step a scheduler takes when it is made: torch 2.13 says so with
    `_is_initial`; before it, that step was the one at epoch 0."""
    return bool(getattr(scheduler, "_is_initial", scheduler.last_epoch == 0))


def _lrs(scheduler: Scheduler) -> List[float]:
    """Each model's lr as it stands (floats: torch's may be tensors, hence get_lr's List[Any])."""
    return [group["lr"] for group in scheduler.optimizer.param_groups]


class StepLR(Scheduler):
    """torch's StepLR per model: lr times gamma every step_size steps. Each model may be at its own
    epoch (HFTA's per-model last_epoch, and `step(epoch=...)` with one epoch or N): `epochs()`
    says where each is; `last_epoch` is model 0's."""

    def __init__(self, optimizer: torch.optim.Optimizer, step_size: Any, gamma: Any = 0.1, last_epoch: Any = -1):
        n = len(optimizer.param_groups)
        self.step_sizes = per_model("step_size", step_size, n, _count)
        self.gammas = per_model("gamma", gamma, n, number(0.0))
        lasts = per_model("last_epoch", last_epoch, n, _epoch)
        for i, (group, last) in enumerate(zip(optimizer.param_groups, lasts)):
            if last == -1:  # what torch's scheduler sets where it starts
                group.setdefault("initial_lr", group["lr"])
            elif "initial_lr" not in group:  # torch's KeyError
                raise WideTesseraError(
                    f"last_epoch={last_epoch!r}: model {i}'s schedule resumes at epoch {last}, and its param group has "
                    "no 'initial_lr' (the schedule it resumes sets it; or give last_epoch=-1 to start it)"
                )
        self.offsets = [last - lasts[0] for last in lasts]  # each model's epoch ahead of model 0's
        super().__init__(optimizer, lasts[0])

    def epochs(self) -> List[int]:
        """Each model's epoch."""
        return [self.last_epoch + offset for offset in self.offsets]

    def step(self, epoch: Any = None) -> None:
        """One step for every model; `epoch` (torch's deprecated closed form): one epoch for all, or N."""
        if epoch is not None:
            epochs = per_model("epoch", epoch, len(self.offsets), _epoch)
            self.offsets = [e - epochs[0] for e in epochs]
            epoch = epochs[0]
        super().step(epoch)

    def get_lr(self) -> List[Any]:
        lrs = zip(_lrs(self), self.epochs(), self.step_sizes, self.gammas)
        return [lr * g if e and e % s == 0 else lr for lr, e, s, g in lrs]

    def _get_closed_form_lr(self) -> List[Any]:
        bases = zip(self.base_lrs, self.epochs(), self.step_sizes, self.gammas)
        return [b * g ** (e // s) for b, e, s, g in bases]


class CosineAnnealingLR(Scheduler):
    """torch's CosineAnnealingLR per model: from the model's lr down to eta_min over T_max steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, T_max: Any, eta_min: Any = 0.0, last_epoch: int = -1):
        n = len(optimizer.param_groups)
        self.lengths = per_model("T_max", T_max, n, _count)
        self.floors = per_model("eta_min", eta_min, n, number(0.0))
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[Any]:
        e, out = self.last_epoch, []
        for lr, base, t, floor in zip(_lrs(self), self.base_lrs, self.lengths, self.floors):
            if _initial(self):
                out.append(lr)
            elif self._step_count == 1 and e > 0:
                out.append(floor + (base - floor) * (1 + math.cos(e * math.pi / t)) / 2)
            elif (e - 1 - t) % (2 * t) == 0:
                out.append(lr + (base - floor) * (1 - math.cos(math.pi / t)) / 2)
            else:
                ratio = (1 + math.cos(math.pi * e / t)) / (1 + math.cos(math.pi * (e - 1) / t))
                out.append(ratio * (lr - floor) + floor)
        return out

    def _get_closed_form_lr(self) -> List[Any]:
        e = self.last_epoch
        pairs = zip(self.base_lrs, self.lengths, self.floors)
        return [f + (b - f) * (1 + math.cos(math.pi * e / t)) / 2 for b, t, f in pairs]


class LinearLR(Scheduler):
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
        self.starts = per_model("start_factor", start_factor, n, number(0.0, 1.0))
        if 0.0 in self.starts:  # torch's would divide by it at the first step
            raise WideTesseraError(f"start_factor={start_factor!r}: give a number in (0, 1], one or one per model")
        self.ends = per_model("end_factor", end_factor, n, number(0.0, 1.0))
        self.totals = per_model("total_iters", total_iters, n, _count)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[Any]:
        e, out = self.last_epoch, []
        for lr, s, end, total in zip(_lrs(self), self.starts, self.ends, self.totals):
            if e == 0:
                out.append(lr * s)
            elif _initial(self) or e > total:
                out.append(lr)
            else:
                out.append(lr * (1.0 + (end - s) / (total * s + (e - 1) * (end - s))))
        return out

    def _get_closed_form_lr(self) -> List[Any]:
        e = self.last_epoch
        return [
            b * (s + (end - s) * min(total, e) / total)
            for b, s, end, total in zip(self.base_lrs, self.starts, self.ends, self.totals)
        ]
