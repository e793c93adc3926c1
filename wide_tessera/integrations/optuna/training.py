"""How one trial trains (`Training`), and the calls every training of a trial makes: its inputs
moved to the device, its step's forward and backward (micro-batches, the user's context), its loss
checked."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...core import trees
from ...core.errors import WideTesseraError, unknown
from ...train import OPTIMIZERS, EachModel, Step, separate_step, wide_step

# schedule(optimizer, params): one trial's learning-rate scheduler over its optimizer
TrialSchedule = Callable[[torch.optim.Optimizer, Dict[str, Any]], Any]
# Training's optional functions, and what each is called with and returns
_CALLED = {
    "evaluate": "evaluate(model, params) -> the value told",
    "schedule": "schedule(optimizer, params) -> a learning-rate scheduler",
    "context": "context() -> a context manager",
}


@dataclass(frozen=True)
class Training:
    """How one trial's model trains: what a sequential objective's loop does, for one model.

    steps: training steps. batch(params, step) -> (input, target) of one trial at a step (an
    input: a tensor, a tuple of positional or a dict of keyword arguments). loss(output, target)
    -> the trial's loss. optimizer: any of wide_tessera.optim's, by its name in lower case ('sgd',
    'adam', 'adamw', 'adadelta'), its settings taken from the trial's parameters by name (what
    torch's optimizer of the name takes per parameter group: lr, momentum, weight_decay, rho,
    eps, betas or beta1/beta2, ...), torch's defaults for the rest. clip: each trial's gradient
    norm limit (None: none). cosine: the learning rate follows a cosine to 0 over `steps`
    (schedule's shorthand). schedule(optimizer, params) -> the trial's learning-rate scheduler,
    torch's or wide_tessera.optim's, as one writes it for one model (a warm-up chain
    SequentialLR([LinearLR, CosineAnnealingLR]), LambdaLR, StepLR, ...; its settings the
    trial's), stepped once per step: sequentially over torch's optimizer, in a group over the
    trial's param group of the group's. report_every: how often the mean loss of the last steps
    is reported to Optuna (and its pruner asked). evaluate(model, params) -> the value told to
    Optuna at the end (default: the last reported mean loss).

    The step itself: micro_batches: gradient accumulation, each step's batch split along its
    first dimension into this many micro-batches (torch.tensor_split), each one's forward and
    backward taken in turn, its loss divided by their count, one optimizer step after the last;
    context() -> a context manager each micro-batch's forward and loss run under
    (`lambda: torch.autocast('cpu', dtype=torch.bfloat16)`); both paths, fused and sequential,
    take the step alike.
    """

    steps: int
    batch: Callable[[Dict[str, Any], int], Tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: str = "adam"
    clip: Optional[float] = None
    cosine: bool = False
    report_every: int = 10
    evaluate: Optional[Callable[[nn.Module, Dict[str, Any]], float]] = None
    schedule: Optional[TrialSchedule] = None
    micro_batches: int = 1
    context: Optional[Callable[[], ContextManager[Any]]] = None

    def __post_init__(self) -> None:
        for name in ("steps", "report_every", "micro_batches"):
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
        for name, valid in _CALLED.items():
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise WideTesseraError(f"Training: {name}={value!r} is not callable: give {valid}, or None")
        if self.cosine and self.schedule is not None:
            raise WideTesseraError("Training: cosine=True and a schedule: give one (cosine=True is a cosine schedule)")
        if hasattr(self.context, "__enter__"):  # (torch.autocast is one, and callable as a decorator)
            raise WideTesseraError(
                f"Training: context={self.context!r} is a context manager: give a function that makes one for each "
                "step (context=lambda: torch.autocast('cpu', dtype=torch.bfloat16))"
            )

    def reports_at(self, step: int) -> bool:
        """Whether a trial reports after `step`: every `report_every`-th step, and the last."""
        return (step + 1) % self.report_every == 0 or step + 1 == self.steps

    def reported(self, losses: List[float]) -> float:
        """What a trial reports: the mean of its last `report_every` losses."""
        recent = losses[-self.report_every :]
        return sum(recent) / len(recent)

    def wide_step(self, fused: nn.Module, params: List[Dict[str, Any]]) -> Step:
        """The step after a backward of N trials trained as one (`fused`), each with its settings
        and its own scheduler (train.EachModel, its `state_dicts` open to a repack)."""
        settings = [self.settings(p) for p in params]
        if not self._scheduled:
            return wide_step(fused, self.optimizer, settings, self.clip)
        makers = [self._scheduler(p) for p in params]
        return wide_step(fused, self.optimizer, settings, self.clip, lambda o: EachModel(o, makers))

    def alone_step(self, model: nn.Module, params: Dict[str, Any]) -> Step:
        """The step after a backward of one trial alone: torch's optimizer, clipping and schedule."""
        schedule = self._scheduler(params) if self._scheduled else None
        return separate_step([model], self.optimizer, [self.settings(params)], self.clip, schedule)

    @property
    def _scheduled(self) -> bool:
        return self.cosine or self.schedule is not None

    def _scheduler(self, params: Dict[str, Any]) -> Callable[[torch.optim.Optimizer], Any]:
        """How one trial's scheduler is made over its optimizer (torch's, or a view of its group)."""

        def make(optimizer: torch.optim.Optimizer) -> Any:
            if self.schedule is None:  # cosine
                return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
            made = self.schedule(optimizer, params)
            plateau = isinstance(made, torch.optim.lr_scheduler.ReduceLROnPlateau)
            if plateau or not isinstance(made, torch.optim.lr_scheduler.LRScheduler):
                raise WideTesseraError(
                    f"Training: schedule(optimizer, params) returned {type(made).__name__}: return a learning-rate "
                    "scheduler of torch's or wide_tessera.optim's stepped once per step (not ReduceLROnPlateau)"
                )
            return made

        return make

    def settings(self, params: Dict[str, Any]) -> Dict[str, Any]:
        """The optimizer's settings in a trial's parameters (a pair, betas, also as beta1 and beta2)."""
        ours = OPTIMIZERS[self.optimizer][1]
        found = {k: params[k] for k in ours.SETTINGS if k in params}
        if "betas" in ours.PAIRS and ("beta1" in params or "beta2" in params):
            found["betas"] = (params.get("beta1", 0.9), params.get("beta2", 0.999))
        return found

    def micro(self, x: Any, y: Any) -> List[Tuple[Any, Any]]:
        """A step's batch as its micro-batches: every tensor of input and target that has a first
        dimension split along it (torch.tensor_split), any other given whole to each."""
        k = self.micro_batches
        if k == 1:
            return [(x, y)]
        leaves, structure = trees.flat((x, y))
        rows = sorted({t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim()})
        if len(rows) != 1 or rows[0] < k:
            raise WideTesseraError(
                f"Training: micro_batches={k}: the batch's tensors have {rows or 'no'} rows along their first "
                f"dimension: give a batch whose tensors have one number of rows, at least {k}"
            )
        pieces = [t.tensor_split(k) if isinstance(t, torch.Tensor) and t.dim() else [t] * k for t in leaves]
        return [trees.unflat([p[j] for p in pieces], structure) for j in range(k)]

    def in_context(self) -> ContextManager[Any]:
        """The context a forward and its loss run under: the user's, else none."""
        return self.context() if self.context is not None else contextlib.nullcontext()


def on_device(device: str, tree: Any) -> Any:
    """Every tensor of `tree` on `device`, its dtype kept (token ids stay integers)."""
    return trees.map_leaves(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def forward_backward(
    training: Training, forward: Callable[[List[Any]], List[Any]], batches: Dict[int, Tuple[Any, Any]], n: int,
    failed: Dict[int, Exception],
) -> Dict[int, float]:  # fmt: skip
    """One step's forward and backward of n models, `forward` running them on n inputs at once
    (model i's at i): each model's batch (`batches`, by index) in its micro-batches
    (Training.micro), each micro-batch's forward and losses under the training's context, each
    loss divided by their count and backwarded (the gradients add up to the step's); each model's
    loss, the sum of those. A model without a batch runs on another's input, its output unused;
    one whose batch did not split or whose loss raised is put in `failed`."""
    pieces: Dict[int, List[Tuple[Any, Any]]] = {}
    for i, (x, y) in batches.items():
        try:
            pieces[i] = training.micro(x, y)
        except Exception as error:  # noqa: BLE001  the trial's own batch: it fails alone
            failed[i] = error
    totals: Dict[int, torch.Tensor] = {}
    for j in range(training.micro_batches):
        live = [i for i in pieces if i not in failed]
        if not live:
            break
        stand_in = pieces[live[0]][j][0]
        xs = [pieces[i][j][0] if i in live else stand_in for i in range(n)]
        losses = {}
        with training.in_context():
            outs = forward(xs)
            for i in live:
                try:
                    losses[i] = loss_of(training, outs[i], pieces[i][j][1]) / training.micro_batches
                except Exception as error:  # noqa: BLE001  the trial's own loss: it fails alone
                    failed[i] = error
        if losses:
            torch.autograd.backward(list(losses.values()))
        for i, loss in losses.items():
            totals[i] = totals[i] + loss.detach() if i in totals else loss.detach()
    return {i: float(total) for i, total in totals.items() if i not in failed}


def loss_of(training: Training, output: Any, target: Any) -> torch.Tensor:
    loss = training.loss(output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WideTesseraError(f"loss(output, target) returned {what}: return one trial's loss, a scalar tensor")
    return loss
