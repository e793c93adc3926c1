"""How one trial trains (`Training`), and the two calls every training of a trial makes: its
inputs moved to the device, its loss checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...core import trees
from ...core.errors import WideTesseraError, unknown
from ...train import OPTIMIZERS, Step, separate_step, wide_step

# the suggested parameters each optimizer takes by name (betas as a pair, or beta1 and beta2)
_SETTINGS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
}


@dataclass(frozen=True)
class Training:
    """How one trial's model trains: what a sequential objective's loop does, for one model.

    steps: training steps. batch(params, step) -> (input, target) of one trial at a step (an
    input: a tensor, a tuple of positional or a dict of keyword arguments). loss(output, target)
    -> the trial's loss. optimizer: 'sgd', 'adam' or 'adamw', its settings taken from the trial's
    parameters by name (lr, momentum, dampening, weight_decay, nesterov, betas or beta1/beta2,
    eps), torch's defaults for the rest. clip: each trial's gradient norm limit (None: none).
    cosine: the learning rate follows a cosine to 0 over `steps`. report_every: how often the
    mean loss of the last steps is reported to Optuna (and its pruner asked). evaluate(model,
    params) -> the value told to Optuna at the end (default: the last reported mean loss).
    """

    steps: int
    batch: Callable[[Dict[str, Any], int], Tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: str = "adam"
    clip: Optional[float] = None
    cosine: bool = False
    report_every: int = 10
    evaluate: Optional[Callable[[nn.Module, Dict[str, Any]], float]] = None

    def __post_init__(self) -> None:
        for name in ("steps", "report_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WideTesseraError(f"Training: {name}={value!r}: give a positive int")
        if self.optimizer not in OPTIMIZERS:
            raise unknown("optimizer", self.optimizer, OPTIMIZERS)
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise WideTesseraError(f"Training: clip={self.clip!r}: give a positive number, or None")
        for name in ("batch", "loss"):
            if not callable(getattr(self, name)):  # (a list of tensors was printed whole)
                raise WideTesseraError(f"Training: {name} is a {type(getattr(self, name)).__name__}, not a function")
        if self.evaluate is not None and not callable(self.evaluate):
            raise WideTesseraError(f"Training: evaluate={self.evaluate!r} is not callable")

    def reports_at(self, step: int) -> bool:
        """Whether a trial reports after `step`: every `report_every`-th step, and the last."""
        return (step + 1) % self.report_every == 0 or step + 1 == self.steps

    def reported(self, losses: List[float]) -> float:
        """What a trial reports: the mean of its last `report_every` losses."""
        recent = losses[-self.report_every :]
        return sum(recent) / len(recent)

    def wide_step(self, fused: nn.Module, params: List[Dict[str, Any]]) -> Step:
        """The step after a backward of N trials trained as one (`fused`), each with its settings."""
        return wide_step(fused, self.optimizer, [self.settings(p) for p in params], self.clip, self._cosine_steps)

    def alone_step(self, model: nn.Module, params: Dict[str, Any]) -> Step:
        """The step after a backward of one trial alone: torch's optimizer, clipping and schedule."""
        return separate_step([model], self.optimizer, [self.settings(params)], self.clip, self._cosine_steps)

    @property
    def _cosine_steps(self) -> Optional[int]:
        return self.steps if self.cosine else None

    def settings(self, params: Dict[str, Any]) -> Dict[str, Any]:
        """The optimizer's settings in a trial's parameters."""
        found = {k: params[k] for k in _SETTINGS[self.optimizer] if k in params}
        if "betas" in _SETTINGS[self.optimizer] and ("beta1" in params or "beta2" in params):
            found["betas"] = (params.get("beta1", 0.9), params.get("beta2", 0.999))
        return found


def on_device(device: str, tree: Any) -> Any:
    """Every tensor of `tree` on `device`, its dtype kept (token ids stay integers)."""
    return trees.map_leaves(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def loss_of(training: Training, output: Any, target: Any) -> torch.Tensor:
    loss = training.loss(output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WideTesseraError(f"loss(output, target) returned {what}: return one trial's loss, a scalar tensor")
    return loss
