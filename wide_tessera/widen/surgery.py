"""Whole models made wide by surgery: every layer a registered op fuses becomes that op's wide
module, and what is left runs over the stacked N axis.

The model is traced once with torch.fx (capture.trace_fx; where it cannot be, torch.export
captures it and exported.py lowers that graph) and its graph rewritten, node by node, so that
every value it computes from the models' inputs or parameters is stacked on a leading N axis
(the rules each node follows are in rules.py):

* a layer every model holds as one frozen layer (a LoRA base: each parameter one frozen tensor,
  core.layout.held_once) is held once and runs once over the N batches folded (rules.Folded),
  and so is a frozen tensor read outside a layer: N stacked copies of a LoRA base are N times
  its memory and N reads of it;
* a submodule whose class a registered op declares in FUSES (nn.Linear, nn.Conv1d, ...) runs as
  that op's wide module, built with its default strategy (its input is moved into the op's
  layout where that is not the stacked one, as the channels of a grouped convolution are),
  where it computes what that class computes (ops.exact); or, where the caller's `choice` says
  the op loses at this size on this machine, as N calls on the models' parts (layers.LayerLoop);
* a call torch tags pointwise (activations, +, *, rsqrt, clamp, ...: rules.is_elementwise, the
  test torch.export's stretches are lowered by) runs on the stacked tensors at once: it cannot
  mix the models;
* everything else (other submodules, reshapes, reductions, a layer an op refuses) runs under
  vmap, as the `vmap` strategy runs the whole model.

vmap over a whole model pays its per-call cost on every layer; the swapped layers do not. On a
2-layer MLP (d=64, hidden=128, batch 32, one CPU thread) surgery ran at 2.89x the speed of vmap
at N=4, 1.91x at N=16 and 1.34x at N=64 (scripts/surgery.py).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..core.errors import NotApplicable, one_line
from ..core.layout import Slot, prefixed, slots_of, tied_aliases
from ..ops.alike import check_alike
from ..ops.base import fusing_ops
from .capture import none_defaults, trace_fx
from .exported import ExportedSurgery
from .functional import WideFunctional
from .layers import LayerChoice, LayerLoop, attribute_held, hand_on_views, hold, keep, wide_layer
from .n_axis import mark, stacked
from .packing import StackedIO, unpacked
from .rules import (
    ELEMENTWISE_MODULES,
    Elementwise,
    Folded,
    GetItem,
    Repeated,
    ShapeQuery,
    Vmapped,
    alone_among_numbers,
    is_elementwise,
    is_model_fact,
    is_shape_query,
    layer_held_once,
    leaf_flags,
    method_call,
)
from .stacked import is_shared

__all__ = ["WideSurgery"]


class WideSurgery(StackedIO, nn.Module):
    """N copies of one traceable module class, layer by layer (see the module's docstring).

    Same interface as WideFunctional: inputs stacked on a leading axis N, outputs (a tensor or
    a tree of them) with N leading. `randomness` is vmap's, for the parts that run under vmap;
    `choice` says which layers an op fuses run as N calls instead (layers.LayerChoice).
    `swapped` names the layers that became an op's wide module, `unfused` those `choice` kept as
    N calls (with its reason), `looped` those run under vmap, `folded` those held once and run
    once over the N batches; in a torch.export capture,
    `captured.vmapped` names the stretches between them that run under vmap, and why.
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
        self.folded: List[str] = []
        self.unfused: Dict[str, str] = {}
        try:
            traced = trace_fx(modules[0])
        except Exception as e:  # noqa: BLE001  whatever stops the tracer: torch.export captures the model
            self.captured = ExportedSurgery(modules, randomness, one_line(e)[:200], choice)
            self.swapped, self.looped, self.unfused = self.captured.swapped, self.captured.looped, self.captured.unfused
            self.folded = self.captured.folded
        else:
            self._rewrite(modules, traced)
        self._classes = _classes_of(modules[0], [*self.swapped, *self.looped, *self.unfused, *self.folded])
        self.train(modules[0].training)

    def _rewrite(self, modules: Sequence[nn.Module], traced: fx.GraphModule) -> None:
        """torch.fx's graph of one model rewritten for N: each layer an op fuses swapped, the rest run under vmap."""
        self._traced_as_none, self._model_name = none_defaults(modules[0]), type(modules[0]).__name__
        graph = traced.graph
        attributes = _attributes(graph, modules, traced)
        folded = _folded_layers(graph, modules)
        following = folded | _activations(graph, modules)
        mark(graph.nodes, lambda node: _source(node, attributes, following))
        holder = nn.Module()  # what the rewritten graph calls
        self._slots: Dict[str, Slot] = {}  # the holder's tensors, by their names in one model
        held: Dict[str, Tuple[str, Any]] = {}  # a model's attribute or layer -> its name in holder (and mask)
        saved, ops = modules[0].state_dict(), fusing_ops()
        for node in list(graph.nodes):
            name = f"n{len(holder._modules) + len(holder._parameters) + len(holder._buffers)}"
            if node.op == "get_attr":
                node.target = self._attribute(holder, name, str(node.target), attributes, held, saved)
            elif node.op == "call_module":
                subs = [m.get_submodule(str(node.target)) for m in modules]
                node.target = self._call_layer(holder, name, node, subs, held, node.target in folded, ops)
            elif node.op in ("call_function", "call_method"):
                self._call(holder, name, node)
            elif node.op == "output":
                self.output_stacked = _output_stacked(node)
        aliases = tied_aliases(modules[0])
        _tie(holder, self._slots, aliases)
        self.graph_module = fx.GraphModule(holder, graph, class_name=f"Wide{type(modules[0]).__name__}")
        hand_on_views(self.graph_module.graph, self.graph_module)
        self._hold_unread(modules, saved, aliases)

    def _attribute(
        self, holder: nn.Module, name: str, where: str, attributes: Dict[str, Any], held: Dict[str, Any],
        saved: Dict[str, Any],
    ) -> str:  # fmt: skip
        """The holder's name of the models' attribute `where`, held there on its first read: read
        twice, it is one tensor, or training would update two copies."""
        if where not in held:
            tensor, layout = attributes[where]
            keep(holder, name, tensor, layout is not None and where in saved)
            held[where] = (name, None)
            if layout is not None and where in saved:
                self._slots[name] = Slot(where, layout)
        return str(held[where][0])

    def _call_layer(
        self, holder: nn.Module, name: str, node: fx.Node, subs: List[nn.Module], held: Dict[str, Any],
        folded: bool, ops: Dict[type, type],
    ) -> str:  # fmt: skip
        """The holder's name of the wide layer standing for `subs` (submodule `node.target` of each
        model), built on its first call for the arguments it is given stacked."""
        where, mask = str(node.target), _mask((node.args, node.kwargs))
        if where not in held:
            layer = self._layer(node, where, subs, mask, folded, ops)
            holder.add_module(name, layer)
            held[where] = (name, mask)
            if layer.state_dict():
                self._slots.update(prefixed(slots_of(layer), name, where))
        elif held[where][1] != mask:
            raise NotApplicable(
                f"surgery: layer {where} is called twice with different arguments stacked; its one wide "
                "layer cannot take both"
            )
        return str(held[where][0])

    def _call(self, holder: nn.Module, name: str, node: fx.Node) -> None:
        """A function or method called on stacked values, as rules.py says it runs: a shape query
        answered for one model; an elementwise call on one stacked value and numbers, as it is; any
        other, by its rule. What no model's value reaches, a model fact (x.device) and a
        ModelOutput made of stacked fields run as they are."""
        if is_shape_query(node) and stacked(node.args[0]):
            holder.add_module(name, ShapeQuery(node))
            node.op, node.target = "call_module", name
            return
        mask = _mask((node.args, node.kwargs))
        if not stacked(node) or _is_record(node):
            return
        elementwise = is_elementwise(node)  # (it reads the op's every overload in torch's registry)
        if elementwise and alone_among_numbers(node, mask):
            return
        fn: Any = node.target if node.op == "call_function" else method_call(str(node.target))
        kind = GetItem if fn is operator.getitem else Elementwise if elementwise else Vmapped
        holder.add_module(name, kind(fn, (mask[0], mask[1]), self.randomness))
        node.op, node.target = "call_module", name

    def _hold_unread(self, modules: Sequence[nn.Module], saved: Dict[str, Any], aliases: Dict[str, str]) -> None:
        """A tensor the forward never reads, held too: it is still each model's (the graph module
        keeps only what its graph reads), and unfuse() and state_dicts() refused to give the models
        back without it."""
        read = {aliases.get(slot.name, slot.name) for slot in self._slots.values()}
        for i, where in enumerate(w for w in saved if w not in aliases and w not in read):
            values = [operator.attrgetter(where)(m) for m in modules]
            self._slots[f"unread{i}"] = Slot(where, hold(self.graph_module, f"unread{i}", values, True))

    def _layer(
        self, node: fx.Node, where: str, subs: List[nn.Module], mask: Any, folded: bool, ops: Dict[type, type]
    ) -> nn.Module:
        """The wide layer standing for `subs` (submodule `where` of each model) at this call;
        `folded`: they are one frozen layer (rules.layer_held_once)."""
        if _is_activation(subs[0]):
            act = _InPlaceUnlessShared(subs[0]) if getattr(subs[0], "inplace", False) else subs[0]
            return act if alone_among_numbers(node, mask) else Elementwise(act, mask, self.randomness)
        if folded:
            self.folded.append(where)
            return Folded(subs[0], mask, self.randomness)
        own = all(leaf_flags(mask[0])) and not node.kwargs  # every argument the models' own, stacked
        wide = wide_layer(subs, ops, self.choice, len(node.args)) if own and node.args else None
        if isinstance(wide, LayerLoop):
            self.unfused[where] = wide.reason
            return wide
        if wide is not None:
            self.swapped.append(where)
            return wide
        self.looped.append(where)
        looped = WideFunctional(subs, self.randomness)
        return looped if own else Repeated(looped, mask, self.n)

    def what_ran(self) -> str:
        """One line on how the N models run: the capture, the layers run as their op's wide
        module, as N calls or under vmap (by class), and what else runs under vmap (after a first
        call, torch.export's stretches): what a benchmark's result says beside the strategy's
        speed, so that a surgery that fused little is not read as one that fused all."""
        layers = [
            ("swapped", self.swapped),
            ("held once", self.folded),
            ("as N calls", list(self.unfused)),
            ("under vmap", self.looped),
        ]
        parts = [f"{how} {len(paths)} layers ({self._counted(paths)})" for how, paths in layers if paths]
        if self.captured is None:
            capture = "torch.fx graph"
            vmapped = [m.fn for m in self.graph_module.modules() if type(m) is Vmapped]
            calls = Counter(getattr(fn, "__name__", str(fn)) for fn in vmapped)
            parts += [f"calls under vmap: {_counted(calls)}"] if calls else []
        else:
            capture = f"torch.export graph (torch.fx: {self.captured.why_not_fx[:80]})"
            stretches = self.captured.vmapped
            parts += [f"stretches under vmap: {'; '.join(stretches.values())}"] if stretches else []
        return f"{capture}: {'; '.join(parts) or 'no layer an op fuses'}"

    def _counted(self, paths: Sequence[str]) -> str:
        return _counted(Counter(self._classes[p] for p in paths))

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


class _InPlaceUnlessShared(nn.Module):
    """An activation in place (nn.ReLU(inplace=True)), out of place on an input all models share,
    passed once: torch refused the write into it. In place elsewhere, as the
    models run it: a skip saved just before it is activated too (out of place everywhere, the
    skip stayed as it was, 1.71 off)."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.act, self.apart = act, copy.copy(act)
        setattr(self.apart, "inplace", False)  # noqa: B010  (an activation's flag, unknown to mypy's nn.Module)

    def forward(self, x: torch.Tensor) -> Any:
        return self.apart(x) if is_shared(x) else self.act(x)


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


def _classes_of(model: nn.Module, paths: Sequence[str]) -> Dict[str, str]:
    """Each layer's class's name, by its path in `model`."""
    return {path: type(model.get_submodule(path)).__name__ for path in paths}


def _counted(counts: "Counter[str]") -> str:
    """'Linear x7, LayerNorm x2'"""
    return ", ".join(f"{name} x{k}" for name, k in counts.most_common())


def _is_record(node: fx.Node) -> bool:
    """Whether the node makes a ModelOutput (a dataclass that is a dict; see capture._Tracer.create_arg)."""
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


def _is_node(a: Any) -> bool:
    return isinstance(a, fx.Node)


def _output_stacked(output: fx.Node) -> List[bool]:
    """Which leaves of the output carry the N axis: one no model's input or parameter shaped is
    the same for all N (and expanded to N by forward)."""
    leaves = _opened(output.args[0])
    return leaf_flags(tree_map(lambda a: not _is_node(a) or stacked(a), leaves, is_leaf=_is_node))


def _mask(tree: Any) -> Any:
    """`tree` (a call's arguments) with each node replaced by whether it carries the N axis, each
    other value by False (a slice is unhashable before Python 3.12: no set of nodes)."""
    return tree_map(stacked, tree, is_leaf=_is_node)


def _attributes(graph: fx.Graph, modules: Sequence[nn.Module], traced: fx.GraphModule) -> Dict[str, Any]:
    """Each attribute the graph reads -> (the N models' tensors as the wide model holds them, how:
    layers.attribute_held); a tensor the tracer made a constant (torch.ones(3) in forward) ->
    (it, None)."""
    attributes: Dict[str, Any] = {}
    for where in dict.fromkeys(str(node.target) for node in graph.nodes if node.op == "get_attr"):
        try:
            values = [operator.attrgetter(where)(m) for m in modules]
        except AttributeError:
            attributes[where] = (operator.attrgetter(where)(traced), None)
        else:
            attributes[where] = attribute_held(values)
    return attributes


def _called(graph: fx.Graph) -> List[str]:
    return list(dict.fromkeys(str(node.target) for node in graph.nodes if node.op == "call_module"))


def _folded_layers(graph: fx.Graph, modules: Sequence[nn.Module]) -> Set[str]:
    """The layers the graph calls that every model holds as one frozen layer (rules.layer_held_once)."""
    return {where for where in _called(graph) if layer_held_once([m.get_submodule(where) for m in modules])}


def _is_activation(layer: nn.Module) -> bool:
    """An elementwise layer holding no tensor (nn.ReLU, nn.GELU, ...)."""
    return isinstance(layer, ELEMENTWISE_MODULES) and not any(p.numel() for p in layer.parameters())


def _activations(graph: fx.Graph, modules: Sequence[nn.Module]) -> Set[str]:
    """The activations the graph calls: each gives values all models share from values they share.
    Taken for a model's own values, an activation of a constant made in forward (relu(torch.ones(4)))
    was added to each model's output as if it held each model's row, and the sizes did not match."""
    return {where for where in _called(graph) if _is_activation(modules[0].get_submodule(where))}


def _source(node: fx.Node, attributes: Dict[str, Any], following: Set[str]) -> Optional[bool]:
    """What a node of torch.fx's graph says of its N axis whatever its inputs say (n_axis.mark):
    an input carries it (but one torch.fx traced as None), an attribute held stacked does, and so
    does a layer holding each model's weights (one held once and an activation, `following`,
    follow their inputs); a shape query and a model fact (x.device) answer for one model, the
    same for all."""
    if node.op == "placeholder":
        return node.args != (None,)
    if node.op == "get_attr":
        layout = attributes[str(node.target)][1]
        return layout is not None and not layout.shared
    if node.op == "call_module":
        return None if node.target in following else True
    if is_model_fact(node) or is_shape_query(node):
        return False
    return None
