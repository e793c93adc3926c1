"""Whether N modules compute what the class an op fuses computes: the one rule by which surgery
swaps a layer for an op's wide module and fuse() picks an op (ops.base.op_fusing applies it, and
fuse() to an op it is told).

A layer is an op's by what it computes, not by its class: timm's BatchNormAct2d is a BatchNorm2d
whose forward also applies an activation, and swapped as a BatchNorm2d it lost it (timm's
InvertedResidual came out of surgery with a relative error of 0.19; fuse() of N of them, a max
error of 5.9). A subclass's own forward is still the op where torch.fx traces it to the graph
its base's forward traces to on the same module: timm's Linear overrides nn.Linear's forward
only to cast under TorchScript.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

__all__ = ["not_the_op", "has_hooks", "times"]


def times(x: torch.Tensor, number: torch.Tensor) -> torch.Tensor:
    """x times `number`, a model's number held as a tensor (float64: a Python float's own value;
    N models' numbers broadcast over x), rounded as torch rounds x times a Python float: in
    float32 for a half-precision x (torch's opmath), once. Multiplied in x's dtype, a bfloat16 x
    took the number rounded to bfloat16 (N LoRA layers of different alphas, 2.3e-3 to 5e-3 off
    their separate calls), and a float64 x took it rounded to float32 (5e-8 off). Written with
    no branch on x's dtype, so that torch.fx can trace it."""
    opmath = torch.promote_types(x.dtype, torch.float32)
    return (x.to(opmath) * number.to(opmath)).to(x.dtype)


def not_the_op(modules: Sequence[nn.Module], base: type) -> Optional[str]:
    """Why `modules` (N of one class deriving from `base`) compute something else than `base`
    does, or None where they compute what it does."""
    cls = type(modules[0])
    hooked = next((i for i, m in enumerate(modules) if has_hooks(m)), None)
    if hooked is not None:  # a hook runs code the op's wide module never would
        return f"module {hooked} ({cls.__name__}) has hooks registered"
    if cls is base:
        return None
    # Every subclass, and each model whose own attributes differ: one overriding a method forward
    # calls (Conv2d's _conv_forward, for weight standardisation) kept the base's forward and was
    # swapped (an error of 16.1); one whose forward branches on its attributes traced to the
    # base's graph on model 0 (scale 1), and models 1 and 2 came out wrong (3.24).
    distinct = {repr(_attributes(m)): m for m in reversed(modules)}
    for module in distinct.values():
        own = _graph(module, cls)
        if own is None or own != _graph(module, base):
            return f"{cls.__name__} computes something of its own where {base.__name__} computes its forward"
    return None


def _attributes(module: nn.Module) -> dict:
    """A module's own plain attributes (not its parameters, buffers or children): what a forward
    can branch on besides its input."""
    return {k: v for k, v in sorted(vars(module).items()) if not k.startswith("_") and k != "training"}


def has_hooks(module: nn.Module) -> bool:
    """Whether `module` has hooks of its own around its forward or backward."""
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def _graph(module: nn.Module, cls: type) -> Optional[List[Tuple[Any, ...]]]:
    """The torch.fx graph of `cls.forward` run on `module`, its nodes named by position; None where
    torch.fx cannot trace it. A copy is traced: the trace runs forward, which may write to self."""
    copied = copy.deepcopy(module)
    copied.__class__ = cls
    try:
        graph = fx.Tracer().trace(copied)
    except Exception:  # noqa: BLE001  whatever stops the tracer: not known to compute what `base` does
        return None
    position = {node: i for i, node in enumerate(graph.nodes)}
    nodes = []
    for i, n in enumerate(graph.nodes):  # a placeholder's target is the argument's name, which may differ
        inputs = fx.node.map_arg((n.args, n.kwargs), position.__getitem__)
        nodes.append((n.op, i if n.op == "placeholder" else n.target, repr(inputs)))
    return nodes
