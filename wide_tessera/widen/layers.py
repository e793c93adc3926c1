"""The pieces both ways of surgery build with: a registered op's wide layer standing for N
submodules (or, where the measurements say that op loses, the N submodules called one by one),
and N models' tensor attribute held stacked, or once."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import fx, nn

from ..core.errors import WideTesseraError
from ..core.layout import STACKED, Layout, Slot, held, loop_slots, models_of, prefixed, slots_of, stacked_tree
from ..ops.base import WideOp, op_fusing

__all__ = ["wide_layer", "hand_on_views", "hold", "attribute_held", "keep", "LayerChoice", "LayerLoop"]

# Why N copies of a layer inside a wide model run as N calls, not as their op's wide module:
# given the op and the N layers, a reason (the op loses there on this machine), or None to fuse
# them. Whoever knows the measurements answers (dispatch.fuse reads the dispatch table); widen
# knows none. A wide model is only as fast as its slowest swap (HFTA calls the cure partial fusion).
LayerChoice = Callable[[Type[WideOp], Sequence[nn.Module]], Optional[str]]


def wide_layer(
    subs: Sequence[nn.Module], ops: Dict[type, type], choice: Optional[LayerChoice] = None, n_args: int = 1
) -> Optional[nn.Module]:
    """The op's wide module of `subs` (submodule `where` of each model) taking and giving tensors
    stacked on a leading N axis, called with `n_args` arguments; None where no op fuses them (no op
    fuses the class, they compute something else than it (ops.exact), its wide module takes fewer
    arguments (WideOp.STACKED_ARGS), or the op refuses this configuration: a grouped convolution).
    A `LayerLoop` where `choice` gives a reason not to fuse them."""
    op = op_fusing(subs, ops)
    if op is None or n_args > op.STACKED_ARGS:
        return None
    reason = None if choice is None else choice(op, subs)
    if reason is not None:
        return LayerLoop(subs, reason)
    try:
        wide = op.from_modules(subs)
    except WideTesseraError:
        return None
    kind: Any = type(wide)
    stacked = kind.pack is WideOp.pack and kind.unpack is WideOp.unpack
    return wide if stacked else _Relayout(wide)


class _Relayout(nn.Module):
    """An op's wide module on stacked input, through the op's own layout (grouped convolutions
    keep the N models' channels side by side)."""

    def __init__(self, wide: nn.Module):
        super().__init__()
        self.wide = wide
        self.view_out = False  # hand the output on as a view of the op's layout (see hand_on_views)

    def model_slots(self) -> Dict[str, Slot]:
        return prefixed(slots_of(self.wide), "wide", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: Any = self.wide  # a WideOp's module: pack and unpack are its own
        n, io = x.shape[0], w.IO_LAYOUT
        if isinstance(io, Layout):  # a view each way (consecutive channel layers pass their values on uncopied)
            out: torch.Tensor = w(STACKED.relaid(x, n, io).contiguous(memory_format=w.memory_format()))
            stacked = io.relaid(out, n, STACKED)
            return stacked if self.view_out else stacked.contiguous()
        return STACKED.join(w.unpack(w(w.pack(STACKED.parts(x, n)))))


def hand_on_views(graph: fx.Graph, root: nn.Module) -> None:
    """Each channel layer's output (a grouped convolution's, a channel norm's) handed on as a view
    of its [B, N*C, ...] layout where every use of it is another such layer, which takes it in
    uncopied; else made contiguous, as each model's own output is: a model's `f.view(b * c, h * w)`
    of the view raised "view size is not compatible", and a reshape in its stead lost the writes
    a model makes through its view. A layer called several times hands on views only where every
    call's uses allow it."""
    called = {node: root.get_submodule(str(node.target)) for node in graph.nodes if node.op == "call_module"}
    for layer in {id(m): m for m in called.values() if isinstance(m, _Relayout)}.values():
        layer.view_out = all(
            isinstance(called.get(user), _Relayout) for node, m in called.items() if m is layer for user in node.users
        )


class LayerLoop(nn.Module):
    """N layers called one by one inside a wide model, each on its model's part of the stacked
    input, their outputs stacked: what the loop computes, with copies of the layers as their
    weights (one model's each). `reason`: why they are not fused."""

    def __init__(self, subs: Sequence[nn.Module], reason: str):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(s) for s in subs)
        self.reason = reason

    def model_slots(self) -> Dict[str, Slot]:
        return loop_slots(self.layers, "layers")

    def forward(self, *stacked: Any) -> Any:
        """The layers on each model's part of every argument (a recurrent layer's input and state),
        their outputs (a tensor, or a recurrent layer's tuple) stacked."""
        mine = models_of(stacked, len(self.layers))
        return stacked_tree([layer(*args) for layer, args in zip(self.layers, mine)])


def hold(holder: nn.Module, name: str, values: List[Any], persistent: bool = True) -> Layout:
    """Each model's tensor attribute as `holder`'s `name` (attribute_held, keep). Returns how it is held."""
    tensor, layout = attribute_held(values)
    keep(holder, name, tensor, persistent)
    return layout


def attribute_held(values: List[Any]) -> Tuple[torch.Tensor, Layout]:
    """Each model's tensor attribute, held once where it is one frozen tensor of all models (the
    models' own: core.layout.held_once), else stacked; and how."""
    if not isinstance(values[0], torch.Tensor):
        raise WideTesseraError(f"surgery: attribute of type {type(values[0]).__name__} read in forward")
    return held(values)


def keep(holder: nn.Module, name: str, tensor: torch.Tensor, persistent: bool = True) -> None:
    """`tensor` as `holder`'s `name`: a parameter stays a parameter; a buffer the models do not
    save (`persistent` False: rotary tables) is not saved here either."""
    if isinstance(tensor, nn.Parameter):
        holder.register_parameter(name, tensor)
    else:
        holder.register_buffer(name, tensor, persistent=persistent)
