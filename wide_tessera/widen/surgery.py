"""Whole models made wide by surgery: every layer a registered op fuses becomes that op's wide
module, and what is left runs over the stacked N axis.

The model is traced once with torch.fx and its graph rewritten so that every value it computes
from the models' inputs or parameters is stacked on a leading N axis:

* a submodule whose class a registered op declares in FUSES (nn.Linear, nn.Conv1d, ...) runs as
  that op's wide module, built with its default strategy (its input is moved into the op's
  layout where that is not the stacked one, as the channels of a grouped convolution are),
  where it computes what that class computes (ops.exact); or, where the caller's `choice` says
  the op loses at this size on this machine, as N calls on the models' parts (layers.LayerLoop);
* an elementwise function (activations, +, *, ...) applied to stacked values of one rank runs
  on the stacked tensors at once: it cannot mix the models;
* everything else (other submodules, reshapes, reductions, a layer an op refuses) runs under
  vmap, as the `vmap` strategy runs the whole model.

vmap over a whole model pays its per-call cost on every layer; the swapped layers do not. On a
2-layer MLP (d=64, hidden=128, batch 32, one CPU thread) surgery ran at 2.89x the speed of vmap
at N=4, 1.91x at N=16 and 1.34x at N=64 (scripts/surgery.py).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..core.errors import NotApplicable, one_line
from ..core.layout import STACKED, Slot, prefixed, slots_of
from ..ops.base import check_alike, fusing_ops
from ..ops.exact import has_hooks
from .exported import ExportedSurgery
from .functional import (
    StackedIO,
    WideFunctional,
    model_size,
    tensors_only,
    tied_aliases,
    unpacked,
    vmap_dims,
    with_others,
)
from .layers import LayerChoice, LayerLoop, hold_stacked, wide_layer

__all__ = ["WideSurgery"]

# Functions that act on each element on its own: applied to stacked tensors of one rank, they
# give what N separate calls give.
_ELEMENTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.tanh, torch.sigmoid, torch.relu,
    F.gelu, F.relu, F.silu, F.leaky_relu, F.elu, F.tanh, F.sigmoid, F.softplus, F.mish, F.hardswish,
}
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "neg", "exp", "tanh", "sigmoid", "relu", "pow"}
_ELEMENTWISE_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Identity)


class _Vmapped(nn.Module):
    """A call that may mix a model's values: vmapped over the stacked arguments (`mask`: which)."""

    def __init__(self, fn: Callable[..., Any], mask: Any, randomness: str):
        super().__init__()
        self.fn, self.randomness = fn, randomness
        args, kwargs = tree_map(lambda stacked: 0 if stacked else None, mask)
        # shaped as the call receives them: fx keeps its arguments in immutable lists and dicts
        self.in_dims = (tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.fn
        values, dims = _fit(self.in_dims, (args, kwargs))
        kept: List[Any] = []
        out = vmap(tensors_only(lambda a, k: fn(*a, **k), kept), in_dims=dims, randomness=self.randomness)(*values)
        return with_others(out, kept)


def _fit(dims: Any, value: Any) -> Tuple[Any, Any]:
    """(values, in_dims) for a call's arguments, where the graph says which are stacked (`dims`):
    within a stacked argument only its tensors are mapped (an optional one may be None at run
    time), and a tensor passed once for all models (expanded) is not."""
    if isinstance(dims, dict):
        fitted = {k: _fit(d, value[k]) for k, d in dims.items()}
        return {k: p[0] for k, p in fitted.items()}, {k: p[1] for k, p in fitted.items()}
    if isinstance(dims, (tuple, list)):
        pairs = [_fit(d, v) for d, v in zip(dims, value)]
        return type(dims)(p[0] for p in pairs), type(dims)(p[1] for p in pairs)
    return (value, None) if dims is None else vmap_dims(value)


class _Elementwise(_Vmapped):
    """An elementwise call on several stacked values: at once when they share a rank (broadcasting
    then pairs model i with model i), else vmapped."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ranks = {x.dim() for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)}
        return self.fn(*args, **kwargs) if len(ranks) == 1 else super().forward(*args, **kwargs)


class _GetItem(_Vmapped):
    """x[i]: one part of a stacked tuple or list as it is; an index into a stacked tensor, vmapped."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(args[0], (tuple, list)):
            return args[0][args[1]]
        return super().forward(*args, **kwargs)


class _ShapeQuery(nn.Module):
    """x.shape, x.size(d), x.dim() or x.ndim of a stacked x, answered for one model: without its N axis."""

    def __init__(self, node: fx.Node):
        super().__init__()
        self.what = node.args[1] if node.op == "call_function" else node.target

    def forward(self, x: torch.Tensor, *args: Any) -> Any:
        if self.what in ("dim", "ndim"):
            return x.dim() - 1
        if self.what == "size" and args:  # size(d): a model's axis d is the stack's d + 1
            return model_size(x, args[0])
        return x.shape[1:]


class _Repeated(nn.Module):
    """A per-model layer given some arguments that are the same for every model: those repeated N times."""

    def __init__(self, layer: nn.Module, mask: Any, n: int):
        super().__init__()
        self.layer, self.mask, self.n = layer, mask, n

    def model_slots(self) -> Dict[str, Slot]:
        return prefixed(slots_of(self.layer), "layer", "")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        repeated = (
            x if st or not isinstance(x, torch.Tensor) else x.expand(self.n, *x.shape) for x, st in zip(args, self.mask)
        )
        return self.layer(*repeated, **kwargs)


class WideSurgery(StackedIO, nn.Module):
    """N copies of one traceable module class, layer by layer (see the module's docstring).

    Same interface as WideFunctional: inputs stacked on a leading axis N, outputs (a tensor or
    a tree of them) with N leading. `randomness` is vmap's, for the parts that run under vmap;
    `choice` says which layers an op fuses run as N calls instead (layers.LayerChoice).
    `swapped` names the layers that became an op's wide module, `unfused` those `choice` kept as
    N calls (with its reason), `looped` those run under vmap.
    The rewritten graph is compiled to Python by torch.fx: walking it node by node in Python
    cost 146 us per call of the 2-layer MLP at N=4, half the call.
    """

    def __init__(self, modules: Sequence[nn.Module], randomness: str = "error", choice: Optional[LayerChoice] = None):
        super().__init__()
        check_alike(modules, "WideSurgery")
        self.n, self.randomness, self.choice = len(modules), randomness, choice
        self.captured: Optional[ExportedSurgery] = None
        self.swapped: List[str] = []
        self.looped: List[str] = []
        self.unfused: Dict[str, str] = {}
        try:
            traced = _trace(modules[0])
        except Exception as e:  # noqa: BLE001  whatever stops the tracer: torch.export captures the model
            self.captured = ExportedSurgery(modules, randomness, one_line(e)[:200], choice)
            self.swapped, self.looped, self.unfused = self.captured.swapped, self.captured.looped, self.captured.unfused
            return
        self._traced_as_none, self._model_name = _none_defaults(modules[0]), type(modules[0]).__name__
        holder = nn.Module()  # what the rewritten graph calls
        graph = traced.graph
        stacked: Set[fx.Node] = set()
        ops = fusing_ops()
        self._slots: Dict[str, Slot] = {}  # the holder's tensors, by their names in one model
        held: Dict[str, Tuple[str, Any]] = {}  # a model's attribute or layer -> its name in holder (and mask)
        saved = modules[0].state_dict()
        for node in list(graph.nodes):
            mask = tree_map(
                lambda a: isinstance(a, fx.Node) and a in stacked,  # (a slice is unhashable before Python 3.12)
                (node.args, node.kwargs),
                is_leaf=lambda a: isinstance(a, fx.Node),
            )
            inputs_stacked = any(a in stacked for a in node.all_input_nodes)
            name = f"n{len(holder._modules) + len(holder._parameters) + len(holder._buffers)}"
            if node.op == "placeholder":
                if node.args != (None,):  # not an argument _trace specialised to None
                    stacked.add(node)
            elif node.op == "get_attr":
                where = node.target
                if where in held:  # read twice: one stacked tensor, or training would update two copies
                    stacked.add(node)
                    node.target = held[where][0]
                    continue
                try:
                    values = [operator.attrgetter(where)(m) for m in modules]
                    hold_stacked(holder, name, values, persistent=where in saved)
                    stacked.add(node)
                    held[where] = (name, None)
                    if where in saved:
                        self._slots[name] = Slot(where, STACKED)
                except AttributeError:  # a tensor the tracer made a constant (torch.ones(3) in forward)
                    holder.register_buffer(name, operator.attrgetter(where)(traced), persistent=False)
                node.target = name
            elif node.op == "call_module":
                where = node.target
                if where not in held:
                    layer = self._layer(node, where, [m.get_submodule(where) for m in modules], mask, ops)
                    holder.add_module(name, layer)
                    held[where] = (name, mask)
                    if layer.state_dict():
                        self._slots.update(prefixed(slots_of(layer), name, where))
                elif held[where][1] != mask:
                    raise NotApplicable(
                        f"surgery: layer {where} is called twice with different arguments stacked; its one wide "
                        "layer cannot take both"
                    )
                node.target = held[where][0]
                if inputs_stacked or not isinstance(getattr(holder, node.target), _ELEMENTWISE_MODULES):
                    stacked.add(node)
            elif _is_record(node):
                if inputs_stacked:  # made of the stacked values as they are: each field is the models' own
                    stacked.add(node)
            elif _is_model_fact(node) and node.args[0] in stacked:
                pass  # x.device, x.dtype, ...: the same for the stack as for each model, and not stacked
            elif _is_shape_query(node) and node.args[0] in stacked:
                # one model's shape, the same for every model: not stacked
                holder.add_module(name, _ShapeQuery(node))
                node.op, node.target = "call_module", name
            elif node.op in ("call_function", "call_method") and inputs_stacked:
                fn = node.target if node.op == "call_function" else _method(node.target)
                if _elementwise(node) and sum(_leaf_flags(mask)) == 1 and _constants_are_numbers(node):
                    pass  # one stacked value and numbers: elementwise on the stack as it is
                else:
                    kind = _GetItem if fn is operator.getitem else _Elementwise if _elementwise(node) else _Vmapped
                    holder.add_module(name, kind(fn, (mask[0], mask[1]), randomness))
                    node.op, node.target = "call_module", name
                stacked.add(node)
            elif node.op == "output":
                # which output leaves no model's input or parameter shaped: the same for all N
                self.output_stacked = _leaf_flags(
                    tree_map(
                        lambda a: not isinstance(a, fx.Node) or a in stacked,
                        _opened(node.args[0]),
                        is_leaf=lambda a: isinstance(a, fx.Node),
                    )
                )
        _tie(holder, self._slots, tied_aliases(modules[0]))
        self.graph_module = fx.GraphModule(holder, graph, class_name=f"Wide{type(modules[0]).__name__}")
        self.train(modules[0].training)

    def _layer(self, node: fx.Node, where: str, subs: List[nn.Module], mask: Any, ops: Dict[type, type]) -> nn.Module:
        """The wide layer standing for `subs` (submodule `where` of each model) at this call."""
        args_mask = list(mask[0])
        if isinstance(subs[0], _ELEMENTWISE_MODULES) and not any(p.numel() for p in subs[0].parameters()):
            return _Elementwise(subs[0], mask, self.randomness) if sum(_leaf_flags(mask)) > 1 else subs[0]
        wide = wide_layer(subs, ops, self.choice) if args_mask == [True] and not node.kwargs else None
        if isinstance(wide, LayerLoop):
            self.unfused[where] = wide.reason
            return wide
        if wide is not None:
            self.swapped.append(where)
            return wide
        self.looped.append(where)
        looped = WideFunctional(subs, self.randomness)
        return looped if all(args_mask) and not node.kwargs else _Repeated(looped, args_mask, self.n)

    def first_call_s(self) -> float:
        """What the next call costs beyond a warm one: torch.export's capture, until it is made."""
        return 0.0 if self.captured is None else self.captured.first_call_s()

    def model_slots(self) -> Dict[str, Slot]:
        if self.captured is not None:
            return prefixed(slots_of(self.captured), "captured", "")
        return prefixed(self._slots, "graph_module", "")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = unpacked(args, kwargs)
        if self.captured is not None:
            return self.captured(args, kwargs)
        self._check_none_given(args, kwargs)
        out = self.graph_module(*args, **kwargs)
        if all(self.output_stacked):
            return out
        leaves, spec = tree_flatten(out)
        leaves = [
            x if st or not isinstance(x, torch.Tensor) else x.expand(self.n, *x.shape)
            for x, st in zip(leaves, self.output_stacked)
        ]
        return tree_unflatten(leaves, spec)

    def _check_none_given(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Refuse a call giving an argument the graph holds as None: it raised torch.fx's "z has been
        specialized to have value None but got another value" (or, given by name, a TypeError)."""
        for name, i in self._traced_as_none.items():
            if kwargs.get(name) is not None or (i is not None and i < len(args) and args[i] is not None):
                raise NotApplicable(
                    f"surgery: torch.fx traced {self._model_name} with {name}=None (as a "
                    f"proxy it is never None, and `if {name} is None` would take the wrong branch), and cannot run a "
                    f"call that gives {name}; the vmap strategy can"
                )


def _none_defaults(model: nn.Module) -> Dict[str, Optional[int]]:
    """Each argument of `model`'s forward whose default is None -> its position (None: keyword only)."""
    params = inspect.signature(model.forward).parameters.values()
    return {p.name: i if p.kind is p.POSITIONAL_OR_KEYWORD else None for i, p in enumerate(params) if p.default is None}


def _tie(holder: nn.Module, slots: Dict[str, Slot], aliases: Dict[str, str]) -> None:
    """Each tensor of one model one wide tensor, however many wide layers use it. A weight tied to
    another (GPT-2's lm_head to its embedding), or read outside its layer's call (F.linear(x,
    self.lin.weight)), was held by each wide layer that used it, and training stepped the copies
    apart (a tied embedding ended 7.4 away from torch after one SGD step). Copies of one shape and
    layout become one parameter; copies that cannot refuse surgery. A layer run as N calls
    (layers.LayerLoop) holds each model's tensor apart: those are the models' own, not copies."""
    first: Dict[Tuple[str, Optional[int]], str] = {}  # (a model's tensor by its first name, owner) -> wide tensor
    for name, slot in slots.items():
        tensor = aliases.get(slot.name, slot.name)
        key = (tensor, slot.layout.model)
        owners = {m for t, m in first if t == tensor}
        if owners and (key[1] is None) != (None in owners):
            raise NotApplicable(
                f"surgery: the models' {tensor} is used by a fused layer and by a layer run as N calls; the vmap "
                "strategy keeps it one tensor"
            )
        if key not in first:
            first[key] = name
            continue
        kept, copy = operator.attrgetter(first[key])(holder), operator.attrgetter(name)(holder)
        if kept.shape != copy.shape or slots[first[key]].layout != slot.layout:
            raise NotApplicable(
                f"surgery: the models' {tensor} is used by two wide layers that hold it in different layouts "
                f"({list(kept.shape)} and {list(copy.shape)}); the vmap strategy keeps it one tensor"
            )
        owner, _, attribute = name.rpartition(".")
        setattr(holder.get_submodule(owner), attribute, kept)


def _trace(model: nn.Module) -> fx.GraphModule:
    """torch.fx's graph of `model`, every argument whose default is None traced as None: as a
    proxy it is never None, so `if mask is None` would take the branch of a given mask. A call
    that gives one is refused (WideSurgery._check_none_given).

    A copy is traced: torch.fx runs forward, and a forward that keeps a value on self
    (transformers' SwitchTransformersTop1Router keeps `self.input_dtype`) left the user's
    module holding a torch.fx Proxy, which no deepcopy or pickle could take ("'node' not in
    new_dict during proxy unpickling") until its next eager call."""
    if has_hooks(model):  # torch.export runs them
        raise NotApplicable("torch.fx traces forward alone, and the model has hooks registered")
    model = copy.deepcopy(model)
    concrete = dict.fromkeys(_none_defaults(model))
    graph = _Tracer(tuple(fusing_ops())).trace(model, concrete_args=concrete or None)
    return fx.GraphModule(model, graph, type(model).__name__)


class _Tracer(fx.Tracer):
    """torch.fx's tracer, keeping whole every layer of a class an op fuses, wherever its class is
    defined: torch.fx keeps only torch.nn's, and would trace through timm's Linear, so it was never
    swapped. One that computes something else than the op (ops.exact: timm's BatchNormAct2d) is
    kept whole too, and runs as itself under vmap, named in `looped`."""

    def __init__(self, fused: Tuple[type, ...]):
        super().__init__()
        self.fused = fused

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return super().is_leaf_module(m, qualname) or isinstance(m, self.fused)

    def create_arg(self, a: Any) -> Any:
        """torch.fx's argument, but a dataclass that is a dict (transformers' ModelOutput) made again
        in the graph: torch.fx keeps only its fields, and the wide model returned a plain dict where
        the models return a BaseModelOutput (INCORRECT, and `out.last_hidden_state` fails)."""
        if isinstance(a, dict) and dataclasses.is_dataclass(a):
            return self.create_node("call_function", type(a), (), {k: self.create_arg(v) for k, v in a.items()})
        return super().create_arg(a)


def _is_record(node: fx.Node) -> bool:
    """Whether the node makes a ModelOutput (a dataclass that is a dict; see _Tracer.create_arg)."""
    target = node.target
    return node.op == "call_function" and isinstance(target, type) and issubclass(target, dict) and (
        dataclasses.is_dataclass(target)
    )


def _opened(arg: Any) -> Any:
    """The output's arguments, each ModelOutput made in the graph opened into its fields, as
    torch's pytree flattens the ModelOutput the graph returns."""
    return tree_map(
        lambda a: _opened(dict(a.kwargs)) if isinstance(a, fx.Node) and _is_record(a) else a,
        arg,
        is_leaf=lambda a: isinstance(a, fx.Node),
    )


def _plain(tree: Any) -> Any:
    if isinstance(tree, list):
        return [_plain(x) for x in tree]
    if isinstance(tree, tuple):
        return tuple(_plain(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _leaf_flags(mask: Any) -> List[bool]:
    out: List[bool] = []
    tree_map(out.append, mask)
    return out


def _constants_are_numbers(node: fx.Node) -> bool:
    leaves: List[Any] = []
    tree_map(leaves.append, (node.args, node.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
    return all(isinstance(a, (fx.Node, int, float, bool, str, type(None))) for a in leaves)


def _is_shape_query(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target is getattr and len(node.args) == 2 and node.args[1] in ("shape", "ndim")
    return node.op == "call_method" and node.target in ("size", "dim") and not node.kwargs


# What a stacked tensor says of itself that each model's tensor would say too. As stacked values,
# a constant made on x.device (torch.tensor([0.5], device=x.device)) was vmapped over no tensor
# and failed the surgery strategy.
_MODEL_FACT_ATTRIBUTES = ("device", "dtype", "is_cuda", "layout")
_MODEL_FACT_METHODS = ("is_floating_point", "is_complex", "element_size", "get_device")


def _is_model_fact(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target is getattr and len(node.args) == 2 and node.args[1] in _MODEL_FACT_ATTRIBUTES
    return node.op == "call_method" and node.target in _MODEL_FACT_METHODS and len(node.args) == 1


def _elementwise(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _ELEMENTWISE
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    return False


def _method(name: str) -> Callable[..., Any]:
    return lambda obj, *a, **k: getattr(obj, name)(*a, **k)
