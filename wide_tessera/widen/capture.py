"""One model's graph, captured once, of a copy (a capture runs forward, and a forward that keeps
a value on self left the user's module holding a proxy).

* torch.fx (`trace_fx`) where it can trace forward: the layers an op fuses are kept whole, and
  an argument whose default is None is traced as None;
* torch.export (`export_graph`) where torch.fx cannot: every dimension of the inputs dynamic
  where the model allows, so a growing sequence reuses one graph. What a capture is specialised
  to (`signature`), the ranges its dimensions take and torch.export's guards make a `Capture`,
  which says whether it takes a new input, or why not; a model keeps at most MOST_CAPTURES.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import fx, nn
from torch.export import Dim
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map

from ..core import trees
from ..core.errors import NotApplicable
from ..core.kept import plain_values
from ..core.layout import named_tensors
from ..ops.alike import layout_of
from ..ops.base import fusing_ops
from ..ops.exact import has_hooks
from .host_draws import python_draws_refused
from .rates import RateDropout
from .stacked import is_shared

__all__ = [
    "CHECKS",
    "SIZE",
    "MOST_CAPTURES",
    "Capture",
    "none_defaults",
    "trace_fx",
    "signature",
    "input_key",
    "export_graph",
    "exports_kept",
    "guards_of",
    "input_dims",
]


# Checks torch.export leaves in its graph for the example's shapes and dtypes: a stacked
# value has one more axis, and vmap has no rule for them.
CHECKS = {torch.ops.aten._assert_tensor_metadata.default}

# A dynamic dimension's size, read from an input (x.shape[1] of a symbolic length). vmap has no
# rule for it: read from the stacked input outside the segments, without its N axis (model_size).
SIZE = torch.ops.aten.sym_size.int


def none_defaults(model: nn.Module) -> Dict[str, Optional[int]]:
    """Each argument of `model`'s forward whose default is None -> its position (None: keyword only)."""
    params = inspect.signature(model.forward).parameters.values()
    return {p.name: i if p.kind is p.POSITIONAL_OR_KEYWORD else None for i, p in enumerate(params) if p.default is None}


def trace_fx(model: nn.Module) -> fx.GraphModule:
    """torch.fx's graph of `model`, every argument whose default is None traced as None: as a
    proxy it is never None, so `if mask is None` would take the branch of a given mask. A call
    that gives one is refused (WideSurgery._check_none_given).

    A copy is traced: torch.fx runs forward, and a forward that keeps a value on self
    (transformers' SwitchTransformersTop1Router keeps `self.input_dtype`) left the user's
    module holding a torch.fx Proxy, which no deepcopy or pickle could take ("'node' not in
    new_dict during proxy unpickling") until its next eager call."""
    if has_hooks(model):  # torch.export runs them
        raise NotApplicable("torch.fx traces forward alone, and the model has hooks registered")
    concrete = dict.fromkeys(none_defaults(model)) or None
    # a graph of each mode: torch.fx reads `self.training` as the Python value it is, and a
    # fused.eval() ran the train branch (dropout, a branch on self.training) for good; a graph that
    # differs between them is torch.export's to capture, one per mode
    graphs, original = [], model
    for training in (False, True):
        model = copy.deepcopy(original).train(training)
        buffers = {id(b) for b in model.buffers()}
        with python_draws_refused("torch.fx"), numbers_kept(model, "torch.fx"), torch.enable_grad():
            tracer = _Tracer(tuple(fusing_ops()))
            graphs.append(tracer.trace(model, concrete_args=concrete))
        tracer.refuse_what_the_graph_drops(graphs[-1], model)
    graph = graphs[1]
    if str(graphs[0]) != str(graph):
        raise NotApplicable("torch.fx traces one mode, and the model's forward differs between train and eval")
    # `self.steps += 1` on a buffer: a proxy has no in-place add, so torch.fx traced an add and
    # assigned its result to the buffer, and the update was never in the graph
    assigned = [f"{path}.{name}".lstrip(".") for path, m in model.named_modules()
                for name, b in m._buffers.items() if b is not None and id(b) not in buffers]  # fmt: skip
    if assigned:
        raise NotApplicable(f"torch.fx cannot keep forward's assignment to buffer {', '.join(assigned)}")
    return fx.GraphModule(model, graph, type(model).__name__)


class _Tracer(fx.Tracer):
    """torch.fx's tracer, keeping whole every layer of a class an op fuses, wherever its class is
    defined: torch.fx keeps only torch.nn's, and would trace through timm's Linear, so it was never
    swapped. One that computes something else than the op (ops.exact: timm's BatchNormAct2d) is
    kept whole too, and runs as itself under vmap, named in `looped`."""

    # A buffer read in forward is a graph input, as a parameter is: torch.fx's default ran what is
    # computed of a buffer alone at trace time, on the traced model's, and kept the result as a
    # constant for all N (`x * self.log_scale.exp()`: models 1 and 2 off by 1.39 and 1.01), and left
    # an update in place (`self.ema.mul_(0.5)`) out of the graph
    proxy_buffer_attributes = True

    def __init__(self, fused: Tuple[type, ...] = ()):
        # () where torch.fx loads a pickled graph module: it traces the module's code again with
        # the tracer's class, built with no arguments, every module kept whole (a surgery-fused
        # model torch.save wrote failed to load: "missing 1 required positional argument")
        super().__init__()
        self.fused = fused
        self.without_gradient: List[fx.Node] = []  # made where forward turned gradients off
        self.autocast = _autocast_state()
        self.autocast_changed: List[fx.Node] = []  # made where forward entered or left torch.autocast

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if not torch.is_grad_enabled():
            self.without_gradient.append(node)
        if _autocast_state() != self.autocast:
            self.autocast_changed.append(node)
        return node

    def refuse_what_the_graph_drops(self, graph: fx.Graph, model: nn.Module) -> None:
        """Refuse a model whose returned values torch.fx's graph would compute otherwise, since it
        records neither grad mode nor autocast: a value computed with gradients off that depends on
        a trained parameter (a teacher under `with torch.no_grad():`, a stop-gradient target of
        shared weights: the graph trained what the models keep fixed, a teacher's weights got
        gradients of 65, a shared weight's 0.66 off), or in a region of torch.autocast (a bfloat16
        region ran in float32, 0.0049 off). What it computes so and returns not
        (a statistic kept in a buffer) is no matter."""
        depends: Dict[fx.Node, Optional[str]] = {}  # a node -> a trained parameter its value depends on
        for node in graph.nodes:
            depends[node] = _trained_read(node, model) or next(
                (depends[a] for a in node.all_input_nodes if depends[a] is not None), None
            )
        returned: Set[fx.Node] = set()
        pending = list(graph.find_nodes(op="output"))
        while pending:
            for a in pending.pop().all_input_nodes:
                if a not in returned:
                    returned.add(a)
                    pending.append(a)
        for node in self.without_gradient:
            if node in returned and depends.get(node) is not None:
                raise _read_without_gradient(str(depends[node]))
        if any(node in returned for node in self.autocast_changed):
            raise _autocast_refused()

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        # a dropout layer kept whole reads its own `training` at each call: traced through, it
        # differs between train and eval, and every model with one went to torch.export (models
        # differing in their dropout's rate too, whose RateDropout a capture took 0.7 to 1.1 s to
        # export, 16 small conv nets, where torch.fx traces them in milliseconds)
        dropout = (nn.modules.dropout._DropoutNd, RateDropout)
        return super().is_leaf_module(m, qualname) or isinstance(m, (*self.fused, *dropout))

    def create_arg(self, a: Any) -> Any:
        """torch.fx's argument, but a dataclass that is a dict (transformers' ModelOutput) made again
        in the graph: torch.fx keeps only its fields, and the wide model returned a plain dict where
        the models return a BaseModelOutput (INCORRECT, and `out.last_hidden_state` fails)."""
        if isinstance(a, dict) and dataclasses.is_dataclass(a):
            return self.create_node("call_function", type(a), (), {k: self.create_arg(v) for k, v in a.items()})
        return super().create_arg(a)


def _trained_read(node: fx.Node, model: nn.Module) -> Optional[str]:
    """The trained parameter `node` reads itself (an attribute, or a layer's), or None."""
    if node.op == "get_attr":
        owner, _, name = str(node.target).rpartition(".")
        held = getattr(model.get_submodule(owner), name, None)
        return str(node.target) if isinstance(held, nn.Parameter) and held.requires_grad else None
    if node.op == "call_module":
        trained = [n for n, p in model.get_submodule(str(node.target)).named_parameters() if p.requires_grad]
        return f"{node.target}.{trained[0]}" if trained else None
    return None


def _autocast_state() -> Tuple[bool, ...]:
    return tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def _autocast_refused() -> NotApplicable:
    return NotApplicable(
        "the model's forward runs a region under torch.autocast, whose dtypes a captured graph does not keep"
    )


def _read_without_gradient(name: str) -> NotApplicable:
    return NotApplicable(
        f"the model's forward reads {name} with gradients off (torch.no_grad in forward), which a captured graph "
        "cannot keep"
    )


class _TrainedWithoutGradient(TorchFunctionMode):
    """The first trained parameter (of `trained`: id -> name), or value computed from one (a view
    of a weight made before the region), that a torch function reads with gradients off."""

    def __init__(self, trained: Dict[int, str]):
        super().__init__()
        self.trained: Dict[int, str] = trained
        self.found: Optional[str] = None
        self.autocast, self.autocast_changed = _autocast_state(), False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.autocast_changed |= _autocast_state() != self.autocast
        # a value computed (x.dtype or x.shape is read, not computed: rotary tables under no_grad)
        if self.found is None and not torch.is_grad_enabled() and trees.tensors(out):
            tensors = [t for t in trees.tensors((args, kwargs)) if t.requires_grad]
            named = (self.trained.get(id(t)) for t in tensors)
            self.found = next((name for name in named if name is not None), None) or (
                "a value computed from its parameters" if tensors else None
            )
        return out


def probe_call(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """A call of a copy of `model` on one model's input (its draws forked off the caller's
    generator), before torch.export captures it, refusing what the call does that the graph
    cannot keep and torch.export does not say: a number the forward sets (torch.export puts the
    module's attributes back), and a trained parameter read with gradients off (a teacher under
    `with torch.no_grad():`: the graph keeps no grad mode, and trained what the models keep
    fixed, a teacher's weights got gradients of 54); and, where torch.export
    says it less clearly, an output it cannot give."""
    probe = copy.deepcopy(model)
    # on copies of the inputs: one model's input is a view of the stacked one, and a model that
    # writes its input in place (`x *= 1.5`, a router's jitter) wrote model 0's part twice
    args, kwargs = trees.clone((args, kwargs))
    mode = _TrainedWithoutGradient({id(p): name for name, p in probe.named_parameters() if p.requires_grad})
    # the CUDA generators of the model's devices too: a probe through dropout would move them on
    cuda = sorted({t.device.index or 0 for t in [*probe.parameters(), *probe.buffers()] if t.is_cuda})
    with numbers_kept(probe, "torch.export"), torch.random.fork_rng(devices=cuda), torch.enable_grad(), mode:
        out = probe(*args, **kwargs)
    if mode.found is not None:
        raise _read_without_gradient(mode.found)
    if mode.autocast_changed:
        raise _autocast_refused()
    # an object holding tensors that torch's pytree does not open (transformers' DynamicCache):
    # torch.export's own words name its class only, cut short in the one line
    closed = next((x for x in tree_flatten(out)[0] if not isinstance(x, torch.Tensor) and trees.tensors(x)), None)
    if closed is not None:
        raise NotApplicable(
            f"torch.export cannot give the model's output: it holds a {type(closed).__name__}, a class torch's pytree "
            "does not know (a transformers model returns no cache with use_cache=False)"
        )


# Captures kept for inputs that still specialise (each a graph of the model and its rewriting):
# without a bound, a model captured per new shape grew by 59 MiB over 64 lengths.
MOST_CAPTURES = 8
_UNBOUNDED = 2**63 - 1


@dataclass(frozen=True)
class Capture:
    """A rewritten graph and what it takes: the input's structure, and per tensor its dtype,
    device and whether it is shared, and per dimension its size or, where dynamic, its range.
    The graph takes the input's leaves and gives the output's, shaped by `out_spec`."""

    graph: fx.GraphModule
    fixed: Any  # training, structure, dtypes, devices, sharing, and every other value (signature)
    dims: Tuple[Tuple[Any, ...], ...]  # per tensor, per dimension: a size, or a (low, high) range
    names: Tuple[str, ...]  # per tensor, its input's name in the graph
    # torch.export's guards (sizes equal to each other, a size's parity, ...) and the positions
    # of the inputs they read among the input's leaves; None where the capture has none
    guards: Optional[Tuple[Callable[..., None], Tuple[int, ...]]]
    out_spec: TreeSpec

    def takes(self, fixed: Any, shapes: Tuple[Tuple[int, ...], ...], leaves: List[Any]) -> bool:
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

    def why_not(self, fixed: Any, shapes: Tuple[Tuple[int, ...], ...], leaves: List[Any]) -> str:
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


def signature(training: bool, spec: TreeSpec, leaves: List[Any]) -> Tuple[Any, Tuple[Tuple[int, ...], ...]]:
    """What a capture is specialised to (the input's structure, each tensor's dtype and device and
    whether it is shared, each other value itself), and each tensor's shape without its N axis,
    of a wide input flattened to `leaves` of structure `spec` (compared as torch.export's own
    module compares its input's)."""
    fixed = (
        training,
        spec,
        tuple((x.dtype, x.device, is_shared(x)) if isinstance(x, torch.Tensor) else repr(x) for x in leaves),
    )
    return fixed, tuple(tuple(x.shape[1:]) for x in leaves if isinstance(x, torch.Tensor))


def input_key(training: bool, spec: TreeSpec, leaves: List[Any]) -> Any:
    """All that `signature` and `Capture.takes` read of a wide input (as `signature` takes it),
    the guards' part too: a guard of torch.export's reads a tensor's sizes, strides and storage
    offset, and any other input. Two inputs of one key are taken alike."""
    return training, spec, tuple(
        (x.dtype, x.device, x.shape, x.stride(), x.storage_offset()) if isinstance(x, torch.Tensor) else repr(x)
        for x in leaves
    )


@contextmanager
def numbers_kept(model: nn.Module, what: str) -> Iterator[None]:
    """Refuse, in one line, a model whose forward changes a value it keeps in plain Python (a
    number, a string, or a list or dict of them: `self.calls += 1`, `self.phase = "main"`,
    `self.seen["steps"] += 1`): a captured graph keeps the branches its capture took on it for
    good, and a warm-up counted in the module ran as its capture's call did at every call (0.67
    off from the third). vmap runs the models' Python, as their calls do."""
    before = _kept(model)
    yield
    after = _kept(model)
    # (by value; a NaN kept unchanged is unchanged, where `!=` called it set)
    changed = next(
        (k for k in after if k not in before or (before[k] != after[k] and repr(before[k]) != repr(after[k]))), None
    )
    if changed is not None:
        raise NotApplicable(
            f"{what}: the model's forward sets {changed} (a value it keeps), which a captured graph cannot follow"
        )


def _kept(model: nn.Module) -> Dict[str, Any]:
    """Every plain value the model's modules keep (core.kept), by its path."""
    kept = ((path, plain_values(m)) for path, m in model.named_modules())
    return {f"{path}.{name}".lstrip("."): value for path, values in kept for name, value in values.items()}


# torch.export's graphs kept within `exports_kept` (None outside it), by what a graph depends on
# (_export_key), each with its model's parameters and buffers on the meta device, so that it
# keeps no model's weights alive.
_KEPT: ContextVar[Optional["OrderedDict[Tuple[type, str], Tuple[fx.GraphModule, Dict[Any, Any]]]"]] = ContextVar(
    "exports_kept", default=None
)
MOST_EXPORTS = 8


@contextmanager
def exports_kept() -> Iterator[None]:
    """Within it, a surgery of models laid out like earlier ones (a probe's switch, a group
    repacked after a pruned trial) reuses their torch.export graph, copied with its own tensors:
    each exported the model again, 0.27 s a time for the small conv net of
    scripts/study_quality.py (2.2 s the first in a process), where a copy takes 0.01 s. A scope
    whose models one code builds (an Optuna study's `build`), not the process: a helper the
    forward calls, changed in a notebook and run again, leaves the class and its layout as they
    were, and a graph kept since would run the old code."""
    token = _KEPT.set(OrderedDict())
    try:
        yield
    finally:
        _KEPT.reset(token)


def export_graph(
    model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[fx.GraphModule, Dict[Any, Any]]:
    """torch.export's graph of `model` on one model's input (probe_call first), and its dynamic
    sizes' ranges; within `exports_kept`, made once for every model laid out alike
    (ops.alike.layout_of, which the N models of one surgery share too) given the same input
    structure, modes and training flags, and copied with `model`'s own tensors in it, as its
    export would hold them. A model with hooks is exported each time (two models' hooks may
    count alike and differ)."""
    kept = _KEPT.get()
    key = None if kept is None or has_hooks(model) else _export_key(model, args, kwargs)
    own = {name for name, _ in named_tensors(model)}
    if kept is not None and key is not None and key in kept:
        kept.move_to_end(key)
        graph, ranges = kept[key]
        return _with_tensors(graph, own, lambda name, _: operator.attrgetter(name)(model)), ranges
    probe_call(model, args, kwargs)
    graph, ranges = _export(model, args, kwargs)
    if kept is not None and key is not None:
        kept[key] = (_with_tensors(graph, own, lambda _, t: torch.empty_like(t, device="meta")), ranges)
        if len(kept) > MOST_EXPORTS:
            kept.popitem(last=False)
    return graph, ranges


def _export_key(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[type, str]:
    """What torch.export's graph of `model` depends on: its class and layout (each module's
    class, tensors' shapes and settings), each module's training flag, the input's structure,
    each leaf's shape, dtype, device and gradient flag (a plain value as it is), and the grad
    and autocast modes."""
    leaves, spec = tree_flatten((args, kwargs))
    inputs = [
        (tuple(t.shape), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor) else repr(t) for t in leaves
    ]
    flags = [m.training for m in model.modules()]
    said = repr((sorted(layout_of(model).items()), flags, spec, inputs, torch.is_grad_enabled(), _autocast_state()))
    return type(model), said  # the class itself: one redefined under its old name is another


def _with_tensors(
    graph: fx.GraphModule, own: Set[str], each: Callable[[str, torch.Tensor], torch.Tensor]
) -> fx.GraphModule:
    """A copy of `graph` whose parameters and buffers named in `own` (the model's) are each(its
    name, it), the others (constants the capture made: torch.tensor(...) in forward) copied as
    they are: a constant taken for a model's tensor was looked up on the next model, which has
    no 'lifted_tensor_0'."""
    memo = {id(t): each(name, t) for name, t in named_tensors(graph) if name in own}
    with warnings.catch_warnings():  # torch's own treespec, copied: "isinstance(treespec, LeafSpec) is deprecated"
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(graph, memo)


def _export(
    model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[fx.GraphModule, Dict[Any, Any]]:
    """torch.export's graph of `model` on one model's input and its dynamic sizes' ranges, every
    dimension dynamic where the model allows. Where declaring them fails, or a size is read from
    a value computed inside the model (which a vmapped segment would have to read), the graph is
    specialised to the input's shapes, as every capture was before."""
    named = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    dynamic = {k: tree_map(lambda t: _auto(t) if isinstance(t, torch.Tensor) else None, v) for k, v in named.items()}
    try:
        program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
        if not _computed_sizes(program.module()):
            return program.module(), program.range_constraints
    except Exception:  # noqa: BLE001  a model whose code cannot take symbolic sizes: one graph per shape
        pass
    program = torch.export.export(model, args, kwargs, strict=False)
    computed = _computed_sizes(program.module())
    if computed:  # (they were copied ahead of the ops that make them: a KeyError)
        raise NotApplicable(
            f"its shapes depend on its values (a size read from what {computed[0]} gives), which vmap cannot batch"
        )
    return program.module(), program.range_constraints


def _computed_sizes(module: fx.GraphModule) -> List[str]:
    """The values computed inside the model whose sizes its graph reads (what aten op makes them)."""
    sizes = module.graph.find_nodes(op="call_function", target=SIZE)
    return [str(n.args[0].target) for n in sizes if n.args[0].op != "placeholder"]


def guards_of(exported: fx.GraphModule, leaves: int) -> Optional[Tuple[Callable[..., None], Tuple[int, ...]]]:
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
    """Each dimension of `t` dynamic, but a size of 0 or 1, which torch.export fixes all the same:
    declared dynamic, it logged a warning the user could do nothing about at every such capture
    (a Llama layer's RoPE tables, batch 1: two per capture, in every run of scripts/real_modules.py).
    A fixed size is Dim.STATIC: None, which torch 2.13 logs as deprecated at every capture."""
    return {i: Dim.AUTO if size > 1 else Dim.STATIC for i, size in enumerate(t.shape)} if t.dim() else None


def input_dims(graph: fx.Graph, ranges: Dict[Any, Any]) -> Tuple[Tuple[str, ...], Tuple[Tuple[Any, ...], ...]]:
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
    # Imported here, where a capture has already loaded sympy: at the top it was sympy's import,
    # 1.2 s of every command's start (`wide_tessera list`, -X importtime, 2-core CPU, loaded)
    from torch.utils._sympy.numbers import int_oo

    # torch's unbounded size (int_oo) says it is finite, and int() of it fails
    return (int(bounds.lower), _UNBOUNDED if bounds.upper == int_oo else int(bounds.upper))
