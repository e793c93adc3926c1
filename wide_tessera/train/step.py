"""What follows a backward, for N models: each clipped to its own gradient norm, stepped, its
gradients zeroed, its learning rate scheduled. Wide: one module holding the N models, stepped by
wide_tessera.optim; separate: N modules, each with its own torch optimizer (what a sweep runs one
trial at a time), or one torch optimizer of N parameter groups in its foreach or fused
implementation. Both sides of a comparison build their step here, so that they differ in what
is compared (one wide update against N) and in nothing else: the order of clip, step, zero and
schedule, and the defaults of a setting a model does not give, are the same on both."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn

from .. import optim

__all__ = ["OPTIMIZERS", "Schedule", "Step", "separate_step", "wide_step"]


def _paired() -> Dict[str, Tuple[Type[torch.optim.Optimizer], Any]]:
    """Every optimizer wide_tessera.optim exports, by its name in lower case, with torch's of it."""
    found: Dict[str, Tuple[Type[torch.optim.Optimizer], Any]] = {}
    for name in optim.__all__:
        ours: Any = getattr(optim, name)
        if isinstance(getattr(ours, "TORCH", None), type):  # one of N models', naming torch's for one
            found[name.lower()] = (ours.TORCH, ours)
    return found


# an optimizer's name, and its two forms: torch's for one model, ours for N models as one
OPTIMIZERS = _paired()

# what schedules an optimizer's learning rates, made when the step is (None: a constant rate): a
# scheduler of torch's or of wide_tessera.optim's, or any object stepped once per step
Schedule = Callable[[torch.optim.Optimizer], Any]


class Step:
    """Clip, step, zero the gradients, schedule: call it after each backward. `optimizers` and
    `schedules` (one per optimizer) are open to a caller that freezes a model, saves its state or
    repacks."""

    def __init__(self, optimizers: List[torch.optim.Optimizer], clip: Callable[[], None], schedule: Optional[Schedule]):
        self.optimizers, self._clip = optimizers, clip
        self.schedules: List[Any] = [schedule(o) for o in optimizers] if schedule is not None else []

    def __call__(self) -> None:
        self._clip()
        for o in self.optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        for s in self.schedules:
            s.step()


def _per_model_kwargs(cls: Type[torch.optim.Optimizer], settings: Sequence[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """N models' settings as our optimizers take them: a list of N per setting any model gives,
    torch's default where a model does not give it."""
    names = sorted(set().union(*settings)) if settings else []
    defaults = inspect.signature(cls).parameters
    return {k: [s[k] if k in s else defaults[k].default for s in settings] for k in names}


def wide_step(
    module: nn.Module,
    optimizer: str,
    settings: Sequence[Dict[str, Any]],
    clip: Optional[float] = None,
    schedule: Optional[Schedule] = None,
) -> Step:
    """The step of one module of N models (what fuse() returned): wide_tessera.optim's `optimizer`
    with the N models' `settings` (one dict each), each model clipped to `clip` by its own norm,
    its learning rates scheduled by `schedule(optimizer)` (None: constant)."""
    cls = OPTIMIZERS[optimizer][1]
    kwargs = _per_model_kwargs(cls, settings)
    # N pairs (Adam's betas) read two ways for two models, and the optimizer refuses them
    # (optim.per_model_pairs): each model's pair goes on its own parameter group instead.
    # (a stand-in for one of ours, as the tests' mutations are, says no PAIRS: betas are the pair)
    pairs = {k: kwargs.pop(k) for k in getattr(cls, "PAIRS", ("betas",)) if k in kwargs}
    opt = cls(module, **kwargs)
    for k, values in pairs.items():
        for group, value in zip(opt.param_groups, values):
            group[k] = tuple(value)

    def clip_each() -> None:
        if clip is not None:
            optim.clip_grad_norm_(module, clip)

    return Step([opt], clip_each, schedule)


def separate_step(
    modules: Sequence[nn.Module],
    optimizer: str,
    settings: Sequence[Dict[str, Any]],
    clip: Optional[float] = None,
    schedule: Optional[Schedule] = None,
    implementation: Optional[str] = None,
) -> Step:
    """The step of N separate modules: torch's `optimizer`, one per model (implementation None,
    torch's default), or one of N parameter groups in 'foreach' or 'fused'; each model clipped to
    `clip` by torch; each optimizer's learning rates scheduled by `schedule(optimizer)`."""
    cls = OPTIMIZERS[optimizer][0]
    if implementation is None:
        optimizers = [cls(m.parameters(), **s) for m, s in zip(modules, settings)]
    else:
        groups = [{"params": list(m.parameters()), **s} for m, s in zip(modules, settings)]
        implemented: Dict[str, Any] = {implementation: True}
        optimizers = [cls(groups, **implemented)]

    def clip_each() -> None:
        if clip is not None:
            for m in modules:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)

    return Step(optimizers, clip_each, schedule)
