"""Each of N models' own learning-rate scheduler over one optimizer of N models: whatever a person
writes for one model (torch's or wide_tessera.optim's schedulers, a warm-up chain, a lambda, a
StepLR), made once per model with that model's settings, over a view of the model's param group.

wide_tessera.optim keeps model i's settings in `param_groups[i]`, and a torch scheduler reads and
sets only `param_groups`: over a view holding that one group, torch's own scheduler schedules
model i exactly as it schedules the model's torch optimizer alone. Each model's scheduler steps
as it would alone (about 10 us a model and step on a CPU, what a sequential loop pays too), and
its state (`state_dicts`) goes with the model to another group or to torch's optimizer."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Sequence

import torch

__all__ = ["EachModel"]


class _ModelGroup(torch.optim.Optimizer):
    """Model i's param group of an optimizer of N models, as a torch optimizer of one group: what
    a scheduler reads and sets (the group itself, shared). The optimizer of N models steps it;
    `_opt_called` tells torch's scheduler so (it warned that the schedule stepped first)."""

    _opt_called = True

    def __init__(self, optimizer: torch.optim.Optimizer, i: int):  # torch's takes parameters: a view has none
        self.param_groups = [optimizer.param_groups[i]]
        self.defaults = optimizer.defaults  # OneCycleLR and CyclicLR read which momentum it has


class EachModel:
    """N schedulers over one optimizer of N models: `makers[i](view)` schedules model i, over a view
    of `optimizer.param_groups[i]`. Stepped, it steps each."""

    def __init__(self, optimizer: torch.optim.Optimizer, makers: Sequence[Callable[[torch.optim.Optimizer], Any]]):
        self.schedulers: List[Any] = [make(_ModelGroup(optimizer, i)) for i, make in enumerate(makers)]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dicts(self) -> List[Dict[str, Any]]:
        """Each model's scheduler state, as its scheduler's `state_dict()` gives it (a copy)."""
        return [copy.deepcopy(s.state_dict()) for s in self.schedulers]

    def load_state_dicts(self, states: Sequence[Dict[str, Any]]) -> None:
        """Each model's scheduler put where `states` say (its optimizer's learning rates are the
        optimizer's state's: load that after the schedulers are made, which set them)."""
        for scheduler, state in zip(self.schedulers, states, strict=True):
            scheduler.load_state_dict(copy.deepcopy(state))
