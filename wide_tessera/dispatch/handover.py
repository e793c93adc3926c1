"""An optimizer made over a first call's loop, which the first call then replaced by a wide module.

`fuse(modules, measure='first-call')` returns the loop until its first call has measured; a user
who builds `torch.optim.Adam(fused.parameters())` before that call holds the loop's parameters,
the N models' own. When the first call chooses a wide module, those tensors stop running: the
optimizer would step tensors that never get a gradient again, and the wide module's would never
be stepped. The loss stayed flat (67.68, 67.68, 67.68 where the models alone fell to 23.49), with
no warning.

So a first call that switches records the loop's parameters as replaced (`replaced`), each with
the wide tensor that now holds it and where, and a hook that runs before every torch optimizer's
step hands each such optimizer over: in each parameter group, the N models' tensors become the
wide tensor that holds them, with their optimizer state joined as the wide tensor holds the
models. A group that holds only some of the N models' copies of a tensor (per-model parameter
groups, for per-model learning rates) cannot be handed over, and the step raises: one wide
tensor cannot take N learning rates in torch's optimizers (wide_tessera.optim's can).

A replaced tensor is handed over only while it has no gradient and its wide tensor has one: an
optimizer over the same modules after `unfuse(into=modules)`, which trains them directly, is left
alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..core.errors import WideTesseraError
from ..core.layout import Layout, slots_of

__all__ = ["replaced"]


@dataclass(frozen=True)
class _Replaced:
    """A loop's parameter that a wide tensor now holds: model `model`'s part of `wide`, laid out as `layout`."""

    wide: torch.Tensor
    layout: Layout
    model: int
    n: int
    name: str


_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a model's parameter -> _Replaced
_hook: List[Any] = []  # the hook's handle, once registered


def replaced(loop: nn.Module, wide: nn.Module, n: int) -> None:
    """Record that `wide` runs in place of `loop` (a LoopedModules of the same N models), so that
    optimizers over the loop's parameters are handed over at their next step."""
    holders: Dict[str, Tuple[torch.Tensor, Layout]] = {}
    wide_params = dict(wide.named_parameters())
    for name, slot in slots_of(wide).items():
        if name in wide_params:
            holders[slot.name] = (wide_params[name], slot.layout)
    loop_params = dict(loop.named_parameters())
    models: Dict[str, List[Optional[torch.Tensor]]] = defaultdict(lambda: [None] * n)  # a wide tensor's N tensors
    for name, slot in slots_of(loop).items():
        if name in loop_params and slot.name in holders and slot.layout.model is not None:
            tensor, layout = holders[slot.name]
            _replaced[loop_params[name]] = _Replaced(tensor, layout, slot.layout.model, n, slot.name)
            models[slot.name][slot.layout.model] = loop_params[name]
    for held, params in models.items():
        _carry_gradients(*holders[held], params)
    if not _hook:
        _hook.append(register_optimizer_step_pre_hook(_hand_over))


def _carry_gradients(wide: torch.Tensor, layout: Layout, params: List[Optional[torch.Tensor]]) -> None:
    """The gradients the N models' tensors hold (accumulated before the first call) carried onto the
    wide tensor that now holds them, and taken off the models': they stayed on tensors that no
    longer run, the wide module's backward started from zero, and an optimizer made before the
    call stepped the stale ones (a weight ended at -0.0013 where the separate models' is -0.158)."""
    grads = [p.grad if p is not None else None for p in params]
    if all(g is None for g in grads):
        return
    joined = layout.join([g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)])  # type: ignore[arg-type]
    wide.grad = joined if wide.grad is None else wide.grad + joined
    for p in params:
        if p is not None:
            p.grad = None


def _hand_over(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before a step: each group's replaced tensors become the wide tensors that hold them (see the module)."""
    if not len(_replaced):
        return None
    for group in optimizer.param_groups:
        found = {id(p): _replaced[p] for p in group["params"] if p in _replaced}
        # a tensor that still runs has a gradient; one whose wide tensor has none did not run either
        stale = [p for p in group["params"] if id(p) in found and p.grad is None and found[id(p)].wide.grad is not None]
        if not stale:
            continue
        by_wide: Dict[int, List[Tuple[_Replaced, torch.Tensor]]] = defaultdict(list)
        for p in stale:
            by_wide[id(found[id(p)].wide)].append((found[id(p)], p))
        wides = []
        for parts in by_wide.values():
            first = parts[0][0]
            if sorted(r.model for r, _ in parts) != list(range(first.n)):
                raise WideTesseraError(
                    f"this optimizer's parameter group holds {len(parts)} of the {first.n} models' {first.name!r}, "
                    "which the first call of fuse() now runs as one wide tensor: torch's optimizers cannot step one "
                    "tensor with several groups' settings; make the optimizer after the first call, or use "
                    "wide_tessera.optim (one setting per model), or fuse(..., strategy=...)"
                )
            ordered = [p for _, p in sorted(parts, key=lambda rp: rp[0].model)]
            state = _joined_state(optimizer, ordered, first)
            if state is not None:
                optimizer.state[first.wide] = state
            for p in ordered:
                optimizer.state.pop(p, None)
            wides.append(first.wide)
        moved = {id(p) for p in stale}
        group["params"] = [p for p in group["params"] if id(p) not in moved] + wides
    return None


def _joined_state(
    optimizer: torch.optim.Optimizer, params: List[torch.Tensor], held: _Replaced
) -> Optional[Dict[str, Any]]:
    """The N models' optimizer state for one tensor, joined as the wide tensor holds them: each
    per-element tensor (Adam's moments) joined by its layout; a scalar (the step count) kept
    where the N agree. None where the optimizer has none yet."""
    states: List[Dict[str, Any]] = [optimizer.state.get(p) or {} for p in params]
    if not any(states):
        return None
    if not all(states) or len({frozenset(s) for s in states}) > 1:
        raise WideTesseraError(f"the optimizer has state for only some of the N models' {held.name!r}; cannot join it")
    joined: Dict[str, Any] = {}
    for key, first in states[0].items():
        values = [s[key] for s in states]
        if isinstance(first, torch.Tensor) and first.shape == params[0].shape and first.dim() > 0:
            joined[key] = held.layout.join(values)
        elif all(_equal(v, first) for v in values):
            joined[key] = first
        else:
            raise WideTesseraError(
                f"the N models' optimizer state {key!r} of {held.name!r} differs between them ({values[0]!r}, ...): "
                "one wide tensor holds one; make the optimizer after the first call, or use wide_tessera.optim"
            )
    return joined


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)
