"""The wide input and output of whole models: N inputs packed as one value, stacked on a new
leading N axis (a tensor all models share passed once), and the wide output unpacked per model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.utils._pytree import register_dataclass, tree_flatten, tree_unflatten

from ..core.errors import WideTesseraError
from ..core.layout import models_of
from ..ops.base import WideOp

__all__ = ["Packed", "unpacked", "StackedIO"]


@dataclass
class Packed:
    """The wide input of a model of several or keyword inputs: one value, so that `wide(wide.pack(xs))`
    calls it as `wide(*args, **kwargs)`, whatever the model's signature (a tree of tensors for torch)."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


register_dataclass(Packed)


def unpacked(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A wide forward's arguments, with one Packed opened."""
    if len(args) == 1 and not kwargs and isinstance(args[0], Packed):
        return args[0].args, args[0].kwargs
    return args, kwargs


class StackedIO(WideOp):
    """The wide layout of whole models. One model's input is a tensor, a tuple of positional
    arguments or a dict of keyword arguments, nested as the model takes them (None where an
    optional argument is left out); the wide input has the same structure, each tensor stacked
    on a new leading axis N. A tensor that is the same object for every model (a mask, RoPE
    tables) is passed once: `expand`ed to N, a view of the one tensor, and what takes the wide
    input may run it once for all (see `vmap_dims`). Each tensor of the output (a tensor, or a
    tuple, list, dict or ModelOutput of them) has N leading. `pack` gives a model of one tensor
    input its stacked tensor, and any other a Packed: the wide module takes either as one value."""

    n: int

    def pack(self, inputs: Sequence[Any]) -> Any:
        """N inputs -> the wide input."""
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise WideTesseraError(f"pack needs a list of the N models' inputs, got {type(inputs).__name__}")
        flat = [tree_flatten(x) for x in inputs]
        for i, (_, spec) in enumerate(flat):
            if spec != flat[0][1]:
                raise WideTesseraError(
                    f"pack: model {i}'s input is shaped {spec}, model 0's {flat[0][1]}; all must have the same"
                )
        leaves = [self._stack([f[0][j] for f in flat], j) for j in range(len(flat[0][0]))]
        wide = tree_unflatten(leaves, flat[0][1])
        if isinstance(wide, tuple):
            return Packed(wide, {})
        return Packed((), wide) if isinstance(wide, dict) else wide

    def _stack(self, values: List[Any], j: int) -> Any:
        """One argument of every model: stacked tensors, one shared tensor expanded, or a value all share."""
        first = values[0]
        if isinstance(first, torch.Tensor) and len(values) > 1 and all(v is first for v in values):
            return first.expand(len(values), *first.shape)
        if isinstance(first, torch.Tensor):
            return super(StackedIO, self).pack(values)
        if any(isinstance(v, torch.Tensor) or v != first for v in values):
            raise WideTesseraError(f"pack: argument {j} differs between the models and is not a tensor: {values!r}")
        return first

    def unpack(self, output: Any) -> List[Any]:
        return models_of(output, self.n)
