"""Surgery of a model torch.fx cannot trace, captured by torch.export instead.

torch.fx runs forward on symbolic proxies, and stops at the first branch on a value: every
transformers layer tried (BertLayer, GPT2Block, LlamaDecoderLayer, ...) was refused, and
transformers 5 dropped its own fx tracer (transformers#41683) for torch.export. torch.export
(non-strict) runs forward as Python on fake tensors, so such code runs as it does eagerly, and
records the ATen ops it reaches, each tagged with the modules it ran in (`nn_module_stack`).
A model is captured on its first call with every dimension of its inputs dynamic where the
model allows (torch.export's Dim.AUTO), so a growing sequence reuses one graph: N=8 Llama decoder
layers fed lengths 1 to 16 were captured 16 times, 219 ms a new length against 2.3 ms a repeat
call. torch.export specialises a dimension of size 0 or 1, and whatever the model's code fixes,
so a new length can still need a new capture (a length of 1, then 2): each capture after the
first says which dimension forced it, and at most _MOST_CAPTURES are kept (the oldest goes).
A capture is also specialised to the input's structure, dtypes, devices, train or eval.

The captured graph is rewritten:

* the ops a fused layer ran (the aten.linear of an nn.Linear, ...) become one call of its
  registered op's wide module, on the stacked input;
* the ops between them are cut into as few segments as the data flow allows, each run as one
  vmapped call over the stacked values. vmap costs per call it enters: cut op by op, a
  LlamaDecoderLayer would enter it about 60 times a call; in segments it enters it 5 times.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import operator
import time
import warnings
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx, nn
from torch.export import Dim
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._sympy.numbers import int_oo

from ..core.errors import NotApplicable, one_line
from ..core.layout import STACKED, Slot, prefixed, slots_of
from ..ops.base import fusing_ops
from .functional import is_shared, model_size, tensors_only, with_others
from .layers import LayerChoice, LayerLoop, hold_stacked, wide_layer
from .moe import WideSparseMoe, is_sparse_moe

__all__ = ["ExportedSurgery"]

# Checks torch.export leaves in its graph for the example's shapes and dtypes: a stacked
# value has one more axis, and vmap has no rule for them.
_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}

# A dynamic dimension's size, read from an input (x.shape[1] of a symbolic length). vmap has no
# rule for it: read from the stacked input outside the segments, without its N axis (model_size).
_SIZE = torch.ops.aten.sym_size.int

# Captures kept for inputs that still specialise (each a graph of the model and its rewriting):
# without a bound, a model captured per new shape grew by 59 MiB over 64 lengths.
_MOST_CAPTURES = 8
_UNBOUNDED = 2**63 - 1


@dataclass(frozen=True)
class _Capture:
    """A rewritten graph and what it takes: the input's structure, and per tensor its dtype,
    device and whether it is shared, and per dimension its size or, where dynamic, its range."""

    graph: fx.GraphModule
    fixed: Hashable  # training, structure, dtypes, devices, sharing, and every other value
    dims: Tuple[Tuple[Any, ...], ...]  # per tensor, per dimension: a size, or a (low, high) range
    names: Tuple[str, ...]  # per tensor, its input's name in the graph
    # torch.export's guards (sizes equal to each other, a size's parity, ...) and the positions
    # of the inputs they read among the input's leaves; None where the capture has none
    guards: Optional[Tuple[Callable[..., None], Tuple[int, ...]]]

    def takes(self, fixed: Hashable, shapes: Tuple[Tuple[int, ...], ...], leaves: List[Any]) -> bool:
        """Whether this graph computes the models' call on the wide input of `leaves`: per
        dimension its range, and the guards torch.export drew from the model's code, on one
        model's values. Without the guards, a model whose branch read `x.shape[1] == y.shape[1]`,
        or `x.shape[1] % 2`, ran the other branch's graph silently (errors of 4.5 and 4.2)."""
        if fixed != self.fixed or not all(
            len(shape) == len(dims) and all(_fits(size, d) for size, d in zip(shape, dims))
            for shape, dims in zip(shapes, self.dims)
        ):
            return False
        return self.failed_guard(leaves) is None

    def failed_guard(self, leaves: List[Any]) -> Optional[str]:
        """torch's words for the first guard the wide input's one model fails, or None."""
        if self.guards is None:
            return None
        check, where = self.guards
        try:
            check(*(leaves[i][0] if isinstance(leaves[i], torch.Tensor) else leaves[i] for i in where))
        except AssertionError as e:  # torch's "Guard failed: y.size()[1] == x.size()[1]"
            return str(e)
        return None

    def why_not(self, fixed: Hashable, shapes: Tuple[Tuple[int, ...], ...], leaves: List[Any]) -> str:
        """Why this capture does not take the wide input, in words."""
        if fixed != self.fixed:
            return "its input's structure, dtypes, devices or mode differ from the last capture's"
        for name, shape, dims in zip(self.names, shapes, self.dims):
            for i, (size, d) in enumerate(zip(shape, dims)):
                if not _fits(size, d):
                    held = f"fixed at {d}" if isinstance(d, int) else f"from {d[0]} to {d[1]}"
                    return f"{name} dimension {i} is {size}, where the last capture took it {held}"
        return f"the last capture's {self.failed_guard(leaves)}"


def _fits(size: int, dim: Any) -> bool:
    return size == dim if isinstance(dim, int) else dim[0] <= size <= dim[1]


class ExportedSurgery(nn.Module):
    """N models of one class as one, through graphs torch.export captures (see the module's
    docstring). Called with the wide input's (args, kwargs): every tensor stacked on N.

    Every layer an op fuses gets its wide module when built (`swapped`; `unfused` names the
    ones `choice` keeps as N calls, layers.LayerChoice; `looped` the ones their op refuses or
    that compute something else (ops.exact), which run in the vmapped segments), so an
    optimiser made before the first call sees every parameter. The rest of
    the models' parameters and buffers are held stacked."""

    # What a capture costs, in seconds: the last one this process made; before any, what a tiny
    # Llama decoder layer's took on the 2-core CPU (1.3 s, torch 2.13). A first call that cannot
    # afford it does not try surgery (dispatch.first_call).
    capture_s = 1.3

    def __init__(
        self, modules: Sequence[nn.Module], randomness: str, why_not_fx: str, choice: Optional[LayerChoice] = None
    ):
        super().__init__()
        self.n, self.randomness, self.why_not_fx = len(modules), randomness, why_not_fx
        # what torch.export runs: one model, kept out of the module tree (its weights are not the wide ones)
        self._skeleton = (copy.deepcopy(modules[0]),)
        for path, sub in list(self._skeleton[0].named_modules()):
            if path and is_sparse_moe(sub):
                self._skeleton[0].set_submodule(path, _MoeStandIn())
        ops = fusing_ops()
        fused = tuple(ops)  # a layer of a class an op fuses: swapped, or named in looped
        self.looped: List[str] = []
        self.unfused: Dict[str, str] = {}  # a layer run as N calls (choice) -> why
        self.wides = nn.ModuleDict()
        self._wide_names: Dict[str, str] = {}  # a swapped or unfused layer's path -> its key in wides
        for path, sub in modules[0].named_modules():
            moe = is_sparse_moe(sub)
            taken = _within([*self._wide_names, *self.looped])
            if not path or not (moe or isinstance(sub, fused)) or path.startswith(taken):
                continue  # (a fused layer's own parts, an nn.MultiheadAttention's out_proj, are its)
            subs = [m.get_submodule(path) for m in modules]
            wide = WideSparseMoe(subs, randomness) if moe else wide_layer(subs, ops, choice)
            if wide is None:
                self.looped.append(path)
                continue
            if isinstance(wide, LayerLoop):
                self.unfused[path] = wide.reason
            self._wide_names[path] = f"w{len(self.wides)}"
            self.wides[self._wide_names[path]] = wide
        self.stacked = nn.Module()
        self._stacked_names: Dict[str, str] = {}  # parameter or buffer path -> its name in stacked
        saved = modules[0].state_dict()
        for path, _ in chain(modules[0].named_parameters(), modules[0].named_buffers()):
            if not path.startswith(_within(list(self._wide_names))):
                self._stacked_names[path] = f"t{len(self._stacked_names)}"
                values = [operator.attrgetter(path)(m) for m in modules]
                hold_stacked(self.stacked, self._stacked_names[path], values, persistent=path in saved)
        self._captures: "OrderedDict[int, _Capture]" = OrderedDict()  # the latest used last
        self.train(modules[0].training)

    @property
    def swapped(self) -> List[str]:
        """The layers run as their op's wide module (a LayerLoop's too are in `wides`)."""
        return [path for path in self._wide_names if path not in self.unfused]

    def model_slots(self) -> Dict[str, Slot]:
        """The swapped layers' slots under their paths, and every other tensor the models save, stacked."""
        slots = {f"stacked.{t}": Slot(path, STACKED) for path, t in self._stacked_names.items()}
        kept = self.stacked.state_dict(keep_vars=True)
        slots = {k: s for k, s in slots.items() if k[len("stacked.") :] in kept}
        for path, w in self._wide_names.items():
            slots.update(prefixed(slots_of(self.wides[w]), f"wides.{w}", path))
        return slots

    def first_call_s(self) -> float:
        """What the next call costs beyond a warm one: a capture, until one is made."""
        return 0.0 if self._captures else ExportedSurgery.capture_s

    def forward(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        fixed, shapes = _signature(self.training, (args, kwargs))
        leaves = tree_flatten((args, kwargs))[0]
        found = next((k for k, c in reversed(self._captures.items()) if c.takes(fixed, shapes, leaves)), None)
        if found is None:
            if self._captures:
                last = next(reversed(self._captures.values()))
                warnings.warn(
                    f"surgery captures {type(self._skeleton[0]).__name__} again: {last.why_not(fixed, shapes, leaves)} "
                    f"(each capture costs a trace; at most {_MOST_CAPTURES} are kept)",
                    stacklevel=2,
                )
            found = max(self._captures, default=-1) + 1
            started = time.perf_counter()
            self._captures[found] = self._capture(args, kwargs, fixed)
            ExportedSurgery.capture_s = time.perf_counter() - started
            if len(self._captures) > _MOST_CAPTURES:
                self._captures.popitem(last=False)
        self._captures.move_to_end(found)
        return self._captures[found].graph(*args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "ExportedSurgery":
        # .to(), .half(), ...: the graphs hold the old tensors and devices; capture again
        self._captures.clear()
        self._skeleton[0]._apply(fn)  # type: ignore[no-untyped-call]
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        return self

    def _capture(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], fixed: Hashable) -> _Capture:
        model = self._skeleton[0].train(self.training)
        one_args, one_kwargs = tree_map(lambda t: t[0] if isinstance(t, torch.Tensor) else t, (args, kwargs))
        try:  # a failed export prints the graph it got so far to stderr, hundreds of lines: the reason is enough
            with contextlib.redirect_stderr(io.StringIO()):
                program = _export(model, tuple(one_args), dict(one_kwargs))
        except Exception as e:  # noqa: BLE001  whatever stops the capture: the vmap strategy covers the model
            why = one_line(e)[:200]
            raise NotApplicable(
                f"neither torch.fx nor torch.export can capture {type(model).__name__}: torch.fx: {self.why_not_fx}; "
                f"torch.export: {why}"
            ) from None
        exported, ranges = program
        names, dims = _input_dims(exported.graph, ranges)
        graph = exported.graph
        guards = _guards(exported, len(tree_flatten((one_args, one_kwargs))[0]))
        for node in list(graph.nodes):
            if (node.op == "call_module" and node.target == "_guards_fn") or node.target in _CHECKS:
                graph.erase_node(node)
            elif node.target is _SIZE:
                node.target = model_size
        self._swap_layers(graph)
        holder = nn.Module()
        holder.s, holder.w, holder.c = self.stacked, self.wides, nn.Module()
        unstacked = self._hold_attributes(graph, exported, holder.c)
        rewritten = fx.GraphModule(holder, _in_segments(graph, holder, unstacked, self.n, self.randomness), "Captured")
        return _Capture(rewritten, fixed, dims, names, guards)

    def _swap_layers(self, graph: fx.Graph) -> None:
        """The ops of each call of a swapped layer, one call of its wide module."""
        calls: Dict[str, Tuple[str, List[fx.Node]]] = {}  # a call of a layer -> (its path, the ops it ran)
        for node in graph.nodes:
            for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():  # the outermost first
                if node.op == "call_function" and path in self._wide_names:
                    calls.setdefault(key, (path, []))[1].append(node)
                    break
        for path, nodes in calls.values():
            inside = set(nodes)
            inputs = {  # (a size read from the input is the wide module's own business)
                a for n in nodes for a in n.all_input_nodes
                if a not in inside and not (a.op == "get_attr" and str(a.target).startswith(path + "."))
                and a.target is not model_size
            }  # fmt: skip
            outputs = [n for n in nodes if any(u not in inside for u in n.users)]
            if len(inputs) != 1 or len(outputs) != 1:
                raise NotApplicable(
                    f"surgery: layer {path} takes {len(inputs)} values and gives {len(outputs)} in this model, where "
                    "its wide module takes one and gives one"
                )
            with graph.inserting_after(nodes[-1]):
                call = graph.create_node("call_module", f"w.{self._wide_names[path]}", (inputs.pop(),))
            outputs[0].replace_all_uses_with(call)
            for node in reversed(nodes):
                graph.erase_node(node)

    def _hold_attributes(self, graph: fx.Graph, exported: nn.Module, constants: nn.Module) -> Set[fx.Node]:
        """Each attribute the graph reads, pointed at its stacked tensor, or, for a constant the
        capture made (torch.ones(3) in forward), held as it is; returns the constants' nodes."""
        unstacked = set()
        for node in [n for n in graph.nodes if n.op == "get_attr"]:
            if not node.users:
                graph.erase_node(node)
            elif node.target in self._stacked_names:
                node.target = f"s.{self._stacked_names[node.target]}"
            elif node.target.startswith(_within(list(self._wide_names))):
                raise NotApplicable(f"surgery: {node.target} is read outside its layer's call (a tied weight?)")
            else:
                name = f"c{len(constants._buffers)}"
                constants.register_buffer(name, operator.attrgetter(node.target)(exported))
                node.target = f"c.{name}"
                unstacked.add(node)
        return unstacked


class _MoeStandIn(nn.Module):
    """What torch.export captures of a sparse MoE block: a copy of its input, which its output is
    shaped as. The block's own experts loop over the experts a batch hit (a data-dependent shape
    torch.export refuses: DbrxBlock's capture failed on it), and its call is WideSparseMoe's anyway."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)).clone()


class _Segment(nn.Module):
    """Ops between swapped layers, one vmapped call over the stacked values (`stacked`: which of
    its arguments are; a tensor passed once for all models, expanded, goes in once). `plain`:
    its outputs are tensors, which vmap returns as they are (a tree of them takes tensors_only,
    30 us a call)."""

    def __init__(self, fn: fx.GraphModule, stacked: List[bool], plain: bool, n: int, randomness: str):
        super().__init__()
        self.fn, self.stacked, self.plain, self.n, self.randomness = fn, stacked, plain, n, randomness

    def forward(self, *values: Any) -> Any:
        mapped = [st and isinstance(v, torch.Tensor) and not is_shared(v) for v, st in zip(values, self.stacked)]
        values = tuple(v[0] if st and is_shared(v) else v for v, st in zip(values, self.stacked))
        if not any(mapped):  # nothing here is any model's own: computed once, shared by all
            out = self.fn(*values)
            return tree_map(lambda t: t.expand(self.n, *t.shape) if isinstance(t, torch.Tensor) else t, out)
        dims = tuple(0 if m else None for m in mapped)
        if self.plain:
            return vmap(self.fn, in_dims=dims, randomness=self.randomness)(*values)
        kept: List[Any] = []
        out = vmap(tensors_only(self.fn, kept), in_dims=dims, randomness=self.randomness)(*values)
        return with_others(out, kept)


def _in_segments(graph: fx.Graph, holder: nn.Module, unstacked: Set[fx.Node], n: int, randomness: str) -> fx.Graph:
    """`graph` with its ops between swapped layers in vmapped segments (added to `holder`).

    A swapped layer's depth is one more than the deepest layer it depends on, and an op's is
    that of the deepest layer it depends on. Segment d holds the ops of depth d: it runs after
    the layers of depth d, which need nothing of it, and before those of depth d + 1."""
    depth: Dict[fx.Node, int] = {}
    segments: Dict[int, List[fx.Node]] = defaultdict(list)
    layers: Dict[int, List[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        swapped = node.op == "call_module"
        depth[node] = max((depth[a] for a in node.all_input_nodes), default=0) + swapped
        if swapped:
            layers[depth[node]].append(node)
        elif node.op in ("call_function", "call_method") and node.target is not model_size:
            segments[depth[node]].append(node)
    out = fx.Graph()
    out._codegen = graph._codegen  # torch.export's: the model's (args, kwargs) in, its output's structure out
    env: Dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:  # inputs, and the sizes read from them (outside vmap, which has no rule for them)
        if node.op in ("placeholder", "get_attr") or node.target is model_size:
            env[node] = out.node_copy(node, env.__getitem__)
    for d in range(max(depth.values(), default=0) + 1):
        for node in layers[d]:
            env[node] = out.node_copy(node, env.__getitem__)
        nodes = segments[d]
        if not nodes:
            continue
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for node in nodes for a in node.all_input_nodes if a not in inside))
        outputs = [node for node in nodes if any(u not in inside for u in node.users)]
        sub = fx.Graph()
        local = {a: sub.placeholder(a.name) for a in inputs}
        for node in nodes:
            local[node] = sub.node_copy(node, local.__getitem__)
        sub.output(tuple(local[o] for o in outputs))
        name = f"g{d}"
        plain = all(isinstance(o.meta.get("val"), torch.Tensor) for o in outputs)
        stacked = [a not in unstacked for a in inputs]
        holder.add_module(name, _Segment(fx.GraphModule(nn.Module(), sub), stacked, plain, n, randomness))
        call = out.call_module(name, tuple(env[a] for a in inputs))
        for j, o in enumerate(outputs):
            env[o] = out.call_function(operator.getitem, (call, j))
    out.node_copy(graph.output_node(), env.__getitem__)
    return out


def _within(paths: Sequence[str]) -> Tuple[str, ...]:
    """Prefixes of what lies inside the layers at `paths` (for str.startswith)."""
    return tuple(p + "." for p in paths)


def _signature(training: bool, value: Any) -> Tuple[Hashable, Tuple[Tuple[int, ...], ...]]:
    """What a capture is specialised to (the input's structure, each tensor's dtype and device and
    whether it is shared, each other value itself), and each tensor's shape without its N axis."""
    leaves, spec = tree_flatten(value)
    fixed = (
        training,
        repr(spec),
        tuple((x.dtype, x.device, is_shared(x)) if isinstance(x, torch.Tensor) else repr(x) for x in leaves),
    )
    return fixed, tuple(tuple(x.shape[1:]) for x in leaves if isinstance(x, torch.Tensor))


def _export(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[fx.GraphModule, Dict[Any, Any]]:
    """torch.export's graph of `model` on one model's input and its dynamic sizes' ranges, every
    dimension dynamic where the model allows. Where declaring them fails, or a size is read from
    a value computed inside the model (which a vmapped segment would have to read), the graph is
    specialised to the input's shapes, as every capture was before."""
    named = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    dynamic = {k: tree_map(lambda t: _auto(t) if isinstance(t, torch.Tensor) else None, v) for k, v in named.items()}
    try:
        program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
        module = program.module()
        if all(n.args[0].op == "placeholder" for n in module.graph.find_nodes(op="call_function", target=_SIZE)):
            return module, program.range_constraints
    except Exception:  # noqa: BLE001  a model whose code cannot take symbolic sizes: one graph per shape
        pass
    program = torch.export.export(model, args, kwargs, strict=False)
    return program.module(), program.range_constraints


def _guards(exported: fx.GraphModule, leaves: int) -> Optional[Tuple[Callable[..., None], Tuple[int, ...]]]:
    """torch.export's guards of a captured graph, and the positions among the input's leaves of
    the inputs they read (the graph's inputs are the input's leaves, in order)."""
    inputs = list(exported.graph.find_nodes(op="placeholder"))
    calls = [n for n in exported.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]
    if not calls:
        return None
    if len(inputs) != leaves:
        raise NotApplicable(f"surgery: torch.export's graph takes {len(inputs)} inputs for {leaves} values given")
    guards: Callable[..., None] = exported.get_submodule("_guards_fn")
    return guards, tuple(inputs.index(a) for a in calls[0].args)


def _auto(t: torch.Tensor) -> Optional[Dict[int, Any]]:
    return {i: Dim.AUTO for i in range(t.dim())} if t.dim() else None


def _input_dims(graph: fx.Graph, ranges: Dict[Any, Any]) -> Tuple[Tuple[str, ...], Tuple[Tuple[Any, ...], ...]]:
    """Per tensor input of an exported graph, its name and, per dimension, its size or, where the
    capture left it dynamic, the (low, high) range it takes."""
    names, dims = [], []
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        names.append(node.name)
        dims.append(tuple(_dim(size, ranges) for size in val.shape))
    return tuple(names), tuple(dims)


def _dim(size: Any, ranges: Dict[Any, Any]) -> Any:
    if isinstance(size, int):
        return size
    bounds = ranges.get(size.node.expr)
    if bounds is None:  # torch.export's least: sizes 0 and 1 are specialised
        return (2, _UNBOUNDED)
    # torch's unbounded size (int_oo) says it is finite, and int() of it fails
    return (int(bounds.lower), _UNBOUNDED if bounds.upper == int_oo else int(bounds.upper))
