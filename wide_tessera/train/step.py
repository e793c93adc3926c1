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

__all__ = ["OPTIMIZERS", "Step", "separate_step", "wide_step"]

# an optimizer's name, and its two forms: torch's for one model, ours for N models as one
OPTIMIZERS: Dict[str, Tuple[Type[torch.optim.Optimizer], Any]] = {
    "sgd": (torch.optim.SGD, optim.SGD),
    "adam": (torch.optim.Adam, optim.Adam),
    "adamw": (torch.optim.AdamW, optim.AdamW),
}


class Step:
    """Clip, step, zero the gradients, schedule: call it after each backward. `optimizers` and
    `schedules` are open to a caller that freezes a model, saves its state or repacks."""

    def __init__(
        self,
        optimizers: List[torch.optim.Optimizer],
        clip: Callable[[], None],
        cosine_steps: Optional[int],
        schedule: Callable[[torch.optim.Optimizer, int, int], Any],
    ):
        self.optimizers, self._clip, self._cosine_steps, self._schedule = optimizers, clip, cosine_steps, schedule
        self.schedules: List[Any] = []
        self.restart_schedules(-1)

    def restart_schedules(self, last_epoch: int) -> None:
        """Each schedule anew at `last_epoch` (-1: from the start; k: k + 1 steps taken, the
        optimizers' learning rates and initial ones as they were then, a repack's)."""
        if self._cosine_steps is not None:
            steps = self._cosine_steps
            self.schedules = [self._schedule(o, steps, last_epoch) for o in self.optimizers]

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
    cosine_steps: Optional[int] = None,
) -> Step:
    """The step of one module of N models (what fuse() returned): wide_tessera.optim's `optimizer`
    with the N models' `settings` (one dict each), each model clipped to `clip` by its own norm,
    its learning rate on a cosine to 0 over `cosine_steps` (None: constant)."""
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

    return Step([opt], clip_each, cosine_steps, lambda o, t, last: optim.CosineAnnealingLR(o, T_max=t, last_epoch=last))


def separate_step(
    modules: Sequence[nn.Module],
    optimizer: str,
    settings: Sequence[Dict[str, Any]],
    clip: Optional[float] = None,
    cosine_steps: Optional[int] = None,
    implementation: Optional[str] = None,
) -> Step:
    """The step of N separate modules: torch's `optimizer`, one per model (implementation None,
    torch's default), or one of N parameter groups in 'foreach' or 'fused'; each model clipped to
    `clip` by torch, its schedule torch's."""
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

    def cosine(o: torch.optim.Optimizer, t: int, last: int) -> Any:
        return torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=t, last_epoch=last)

    return Step(optimizers, clip_each, cosine_steps, cosine)
