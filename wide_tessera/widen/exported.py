"""Surgery of a model torch.fx cannot trace, captured by torch.export instead (capture.export_graph;
what follows says why, and how its graph is lowered).

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
first says which dimension forced it, and at most MOST_CAPTURES are kept (the oldest goes).
A capture is also specialised to the input's structure, dtypes, devices, train or eval.

The captured graph is rewritten:

* the ops a fused layer ran (the aten.linear of an nn.Linear, ...) become one call of its
  registered op's wide module, on the stacked input;
* the ops between them are cut into as few segments as the data flow allows, each run as one
  vmapped call over the stacked values. vmap costs per call it enters: cut op by op, a
  LlamaDecoderLayer would enter it about 60 times a call; in segments it enters it 5 times.
  A segment lowering.py lowers runs at once instead; where it does so at every call (given a
  model's own value, and too few passes over its values to run in groups), its lowered ops are
  the graph's own, as torch.fx's graph calls its ops, else a Segment decides at each call.

The rewritten graph takes the input's leaves; an input of the last one's input_key runs on the
capture that took it, found without a lookup.
"""

from __future__ import annotations

import contextlib
import io
import operator
import time
import warnings
from collections import OrderedDict, defaultdict
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx, nn
from torch.fx.graph import _PyTreeCodeGen
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from ..core.errors import NotApplicable, one_line
from ..core.layout import SHARED, STACKED, Slot, prefixed, second_names, slots_of, tied_aliases
from ..ops.base import fusing_ops
from .capture import (
    CHECKS,
    MOST_CAPTURES,
    SIZE,
    Capture,
    export_graph,
    guards_of,
    input_dims,
    input_key,
    signature,
)
from .host_draws import python_draws_refused
from .layers import LayerChoice, LayerLoop, hand_on_views, hold, wide_layer
from .lowering import Lowered, lower
from .moe import WideSparseMoe, exportable_copy, is_sparse_moe
from .n_axis import mark
from .n_axis import stacked as is_stacked
from .rules import Segment, layer_held_once, may_group
from .stacked import is_shared, model_size

__all__ = ["ExportedSurgery"]


class ExportedSurgery(nn.Module):
    """N models of one class as one, through graphs torch.export captures (see the module's
    docstring). Called with the wide input's (args, kwargs): every tensor stacked on N.

    Every layer an op fuses gets its wide module when built (`swapped`; `unfused` names the
    ones `choice` keeps as N calls, layers.LayerChoice; `looped` the ones their op refuses or
    that compute something else (ops.exact), which run in the vmapped segments), so an
    optimiser made before the first call sees every parameter. A layer every model holds as one
    frozen layer (rules.layer_held_once: a LoRA base) is not swapped (`folded`): its tensors are
    held once and its ops run in the segments over the N batches. The rest of the models'
    parameters and buffers are held stacked, but a frozen tensor all hold, held once."""

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
        self._skeleton = (exportable_copy(modules[0]),)
        self.looped: List[str] = []
        self.folded: List[str] = []
        self.unfused: Dict[str, str] = {}  # a layer run as N calls (choice) -> why
        self.wides = nn.ModuleDict()
        self._wide_names: Dict[str, str] = {}  # a swapped or unfused layer's path -> its key in wides
        self._build_wides(modules, randomness, choice)
        self.stacked = nn.Module()
        self._stacked_names: Dict[str, str] = {}  # parameter or buffer path -> its name in stacked
        self._once: Set[str] = set()  # the paths of those held once (core.layout.held_once)
        # the swapped layers' tensors their wide modules hold (a tensor's path in a model -> its name
        # in the holder where the wide module holds it stacked, as a tensor read outside a layer is
        # held, else None: a grouped convolution's weight is joined); a weight its layer uses and
        # forward reads again (F.linear(x, self.lin.weight)) is then one tensor, trained once. One a
        # layer holds beside them (a GRU's `rnn.h0` the model added, given as its state) is held
        # stacked as any other: it was dropped, and the wide GRU ran from zeros
        self._in_wides: Dict[str, Optional[str]] = {
            f"{path}.{slot.name}": f"w.{w}.{name}" if slot.layout == STACKED else None
            for path, w in self._wide_names.items() for name, slot in slots_of(self.wides[w]).items()
        }  # fmt: skip
        self._hold_the_rest(modules)
        # A layer, parameter or buffer registered under two names (a layer shared by two blocks)
        # is found by named_modules and named_parameters under its first; torch.export's graph
        # may call or read it by the other, which was then neither swapped nor stacked, but held
        # as a constant of the captured model's: every model ran with model 0's weights. Each second
        # name -> its first.
        self._aliases = {**tied_aliases(modules[0]), **second_names(modules[0].named_modules(remove_duplicate=False))}
        self._captures: "OrderedDict[int, Capture]" = OrderedDict()  # the latest used last
        # the last input's input_key and the capture that took it (a list: setting a module's attribute
        # costs 5 us a call)
        self._last: List[Any] = [None, None]
        self.train(modules[0].training)

    def _build_wides(self, modules: Sequence[nn.Module], randomness: str, choice: Optional[LayerChoice]) -> None:
        """Each layer an op fuses, in wides (its wide module, or a LayerLoop where `choice` keeps
        it as N calls); the rest named in looped (run as their ops) or folded (held once)."""
        ops = fusing_ops()
        fused = tuple(ops)  # a layer of a class an op fuses: swapped, or named in looped
        holders = _holders(modules[0])
        for path, sub in modules[0].named_modules():
            moe = is_sparse_moe(sub)
            taken = _within([*self._wide_names, *self.looped])
            reads_its_layers = isinstance(sub, _READS_ITS_LAYERS) and not isinstance(sub, fused)
            if path and reads_its_layers and not path.startswith(taken):
                self.looped.append(path)  # run as its ops, its layers' tensors stacked
                continue
            if not path or not (moe or isinstance(sub, fused)) or path.startswith(taken):
                continue  # (a fused layer's own parts, an nn.MultiheadAttention's out_proj, are its)
            if _tied_outside(sub, holders):
                self.looped.append(path)
                continue
            subs = [m.get_submodule(path) for m in modules]
            if layer_held_once(subs):
                self.folded.append(path)
                continue
            wide = WideSparseMoe(subs, randomness) if moe else wide_layer(subs, ops, choice)
            if wide is None:
                self.looped.append(path)
                continue
            if isinstance(wide, LayerLoop):
                self.unfused[path] = wide.reason
            self._wide_names[path] = f"w{len(self.wides)}"
            self.wides[self._wide_names[path]] = wide

    def _hold_the_rest(self, modules: Sequence[nn.Module]) -> None:
        """Every parameter and buffer no wide module holds, in `stacked`: stacked on N, or once
        where every model holds the same frozen tensor."""
        saved = modules[0].state_dict()
        for path, _ in chain(modules[0].named_parameters(), modules[0].named_buffers()):
            if path not in self._in_wides:
                self._stacked_names[path] = f"t{len(self._stacked_names)}"
                values = [operator.attrgetter(path)(m) for m in modules]
                if hold(self.stacked, self._stacked_names[path], values, persistent=path in saved).shared:
                    self._once.add(path)

    @property
    def swapped(self) -> List[str]:
        """The layers run as their op's wide module (a LayerLoop's too are in `wides`)."""
        return [path for path in self._wide_names if path not in self.unfused]

    @property
    def vmapped(self) -> Dict[str, str]:
        """The stretches between swapped layers of the latest capture that run under vmap, each
        with the op no rule of lowering.py takes; empty where every stretch runs at once."""
        if not self._captures:
            return {}
        graph = next(reversed(self._captures.values())).graph
        return {name: m.why_vmapped for name, m in graph.named_modules() if isinstance(m, Segment) and m.once is None}

    def model_slots(self) -> Dict[str, Slot]:
        """The swapped layers' slots under their paths, and every other tensor the models save, stacked."""
        slots = {
            f"stacked.{t}": Slot(path, SHARED if path in self._once else STACKED)
            for path, t in self._stacked_names.items()
        }
        kept = self.stacked.state_dict(keep_vars=True)
        slots = {k: s for k, s in slots.items() if k[len("stacked.") :] in kept}
        for path, w in self._wide_names.items():
            slots.update(prefixed(slots_of(self.wides[w]), f"wides.{w}", path))
        return slots

    def first_call_s(self) -> float:
        """What the next call costs beyond a warm one: a capture, until one is made."""
        return 0.0 if self._captures else ExportedSurgery.capture_s

    def forward(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        # An input of the last one's key runs on the capture that took it: found by its guards at every
        # call, it cost 100 us of a 1.3 ms call (scripts/capture_paths.py's Mlp, one thread, loaded 2-core CPU)
        key = input_key(self.training, spec, leaves)
        if self._last[0] != key or self._last[1] not in self._captures:
            self._last[:] = key, self._found(args, kwargs, spec, leaves)
        capture = self._captures[self._last[1]]
        return tree_unflatten(capture.graph(*leaves), capture.out_spec)

    def _found(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], spec: TreeSpec, leaves: List[Any]) -> int:
        """The capture that takes the wide input (`leaves` of structure `spec`), the latest used
        first, made where none does; it is the latest used now."""
        fixed, shapes = signature(self.training, spec, leaves)
        found = next((k for k, c in reversed(self._captures.items()) if c.takes(fixed, shapes, leaves)), None)
        if found is None:
            if self._captures:
                last = next(reversed(self._captures.values()))
                warnings.warn(
                    f"surgery captures {type(self._skeleton[0]).__name__} again: {last.why_not(fixed, shapes, leaves)} "
                    f"(each capture costs a trace; at most {MOST_CAPTURES} are kept)",
                    stacklevel=3,
                )
            found = max(self._captures, default=-1) + 1
            started = time.perf_counter()
            self._captures[found] = self._capture(args, kwargs, fixed)
            ExportedSurgery.capture_s = time.perf_counter() - started
            if len(self._captures) > MOST_CAPTURES:
                self._captures.popitem(last=False)
        self._captures.move_to_end(found)
        return found

    def __getstate__(self) -> Dict[str, Any]:
        """What pickling keeps: all but the captures, a cache of graphs whose torch.export guards hold
        a function pickle cannot take (torch.save of a fused model failed once it had run); a loaded
        module captures again at its first call, as a new one does."""
        state = dict(self.__dict__)
        state["_captures"], state["_last"] = OrderedDict(), [None, None]
        return state

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "ExportedSurgery":
        # .to(), .half(), ...: the graphs hold the old tensors and devices; capture again
        self._captures.clear()
        self._skeleton[0]._apply(fn)  # type: ignore[no-untyped-call]
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        return self

    def _capture(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], fixed: Any) -> Capture:
        model = self._skeleton[0].train(self.training)
        one_args, one_kwargs = tree_map(lambda t: t[0] if isinstance(t, torch.Tensor) else t, (args, kwargs))
        try:  # a failed export prints the graph it got so far to stderr, hundreds of lines: the reason is enough
            with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
                # nn.GRU and nn.LSTM rebuild their weight list in forward, which torch.export calls a
                # tensor attribute assigned during export: torch's own module, nothing the user can change
                warnings.filterwarnings("ignore", message="The tensor attributes .* were assigned during export")
                with python_draws_refused("torch.export"):
                    program = export_graph(model, tuple(one_args), dict(one_kwargs))
        except Exception as e:  # noqa: BLE001  whatever stops the capture: the vmap strategy covers the model
            why = one_line(e)[:200]
            raise NotApplicable(
                f"neither torch.fx nor torch.export can capture {type(model).__name__}: torch.fx: {self.why_not_fx}; "
                f"torch.export: {why}"
            ) from None
        exported, ranges = program
        names, dims = input_dims(exported.graph, ranges)
        graph = exported.graph
        guards = guards_of(exported, len(tree_flatten((one_args, one_kwargs))[0]))
        for node in list(graph.nodes):
            if (node.op == "call_module" and node.target == "_guards_fn") or node.target in CHECKS:
                graph.erase_node(node)
            elif node.target is SIZE:
                node.target = model_size
            elif node.op == "get_attr":
                node.target = self._aliases.get(node.target, node.target)
            elif _copies_itself(node):
                graph.erase_node(node)
        self._swap_layers(graph)
        mark(graph.nodes, self._source)
        holder = nn.Module()
        holder.s, holder.w, holder.c = self.stacked, self.wides, nn.Module()
        self._hold_attributes(graph, exported, holder.c)
        own = _own_values(graph, tree_flatten((args, kwargs))[0])
        rewritten = fx.GraphModule(holder, _in_segments(graph, holder, self.n, self.randomness, own), "Captured")
        hand_on_views(rewritten.graph, rewritten)
        codegen = graph._codegen  # torch.export's: the model's (args, kwargs) in, its output's structure out
        assert isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info.out_spec is not None
        return Capture(rewritten, fixed, dims, names, guards, codegen.pytree_info.out_spec)

    def _swap_layers(self, graph: fx.Graph) -> None:
        """The ops of each call of a swapped layer, one call of its wide module."""
        calls: Dict[str, Tuple[str, List[fx.Node]]] = {}  # a call of a layer -> (its path, the ops it ran)
        for node in graph.nodes:
            for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():  # the outermost first
                path = self._aliases.get(path, path)
                if node.op == "call_function" and path in self._wide_names:
                    calls.setdefault(key, (path, []))[1].append(node)
                    break
        for path, nodes in calls.values():
            inside = set(nodes)
            inputs = {  # (a size read from the input is the wide module's own business)
                a for n in nodes for a in n.all_input_nodes
                if a not in inside and not (a.op == "get_attr" and str(a.target) in self._in_wides)
                and a.target is not model_size
            }  # fmt: skip
            outputs = [n for n in nodes if any(u not in inside for u in n.users)]
            arguments = _layer_arguments(nodes, inputs)
            if arguments is None or len(outputs) != 1:
                raise NotApplicable(
                    f"surgery: layer {path} takes {len(inputs)} values and gives {len(outputs)} in this model, where "
                    "a torch.export capture swaps a layer taking one (or a recurrent layer's input and initial "
                    "state) and giving one"
                )
            out = outputs[0]
            # nn.GRU and nn.LSTM return (output, state), and their wide modules too; a model that
            # reads only the output reads their op's first result (the wide module's whole tuple
            # went on as that tensor, and the next op failed on a tuple)
            recurrent = isinstance(self._skeleton[0].get_submodule(path), nn.RNNBase)
            source: Any = out.args[0] if out.args else None
            if recurrent and not (out.target is operator.getitem and source in inside and out.args[1] == 0):
                raise NotApplicable(f"surgery: the model reads {out.name} of layer {path}, not its output alone")
            with graph.inserting_after(nodes[-1]):
                call = graph.create_node("call_module", f"w.{self._wide_names[path]}", arguments)
            with graph.inserting_after(call):
                value = graph.call_function(operator.getitem, (call, 0)) if recurrent else call
            # one model's output, as the rules read it (a recurrent layer's: its op's tuple, led by the output)
            call.meta["val"] = source.meta.get("val") if recurrent else out.meta.get("val")
            value.meta["val"] = out.meta.get("val")
            out.replace_all_uses_with(value)
            for node in reversed(nodes):
                graph.erase_node(node)

    def _source(self, node: fx.Node) -> Optional[bool]:
        """What a node of torch.export's graph says of its N axis whatever its inputs say
        (n_axis.mark): an input carries it, and so do a swapped layer's output and a model's tensor
        held stacked; one held once and a constant the capture made do not, nor a size read from
        a value, which answers for one model."""
        if node.op in ("placeholder", "call_module"):
            return True
        if node.op == "get_attr":
            target = str(node.target)
            own = target in self._stacked_names and target not in self._once
            return own or self._in_wides.get(target) is not None
        return False if node.target is model_size else None

    def _hold_attributes(self, graph: fx.Graph, exported: nn.Module, constants: nn.Module) -> None:
        """Each attribute the graph reads, pointed at its stacked tensor (or the one held once), or,
        for a constant the capture made (torch.ones(3) in forward), held as it is."""
        for node in [n for n in graph.nodes if n.op == "get_attr"]:
            if not node.users:
                graph.erase_node(node)
            elif node.target in self._stacked_names:
                node.target = f"s.{self._stacked_names[node.target]}"
            elif node.target in self._in_wides:
                held = self._in_wides[node.target]
                if held is None:
                    raise NotApplicable(
                        f"surgery: {node.target} is read outside its layer's call, whose wide module does not hold it "
                        "stacked; the vmap strategy keeps it one tensor"
                    )
                node.target = held
            elif isinstance(operator.attrgetter(node.target)(exported), nn.Module):  # a torch.no_grad region's
                raise NotApplicable(  # graph: registered as a constant, torch's TypeError
                    "surgery: torch.export captured a region of forward that switches gradients off (torch.no_grad), "
                    "which surgery does not lower"
                )
            else:
                name = f"c{len(constants._buffers)}"
                constants.register_buffer(name, operator.attrgetter(node.target)(exported))
                node.target = f"c.{name}"


# A recurrent layer's ATen op: (input, initial state, ...), the state one tensor or an LSTM's [h, c]
_RECURRENT = {torch.ops.aten.gru.input, torch.ops.aten.lstm.input, torch.ops.aten.rnn_tanh.input,
              torch.ops.aten.rnn_relu.input}  # fmt: skip


def _layer_arguments(nodes: List[fx.Node], inputs: Set[fx.Node]) -> Optional[Tuple[Any, ...]]:
    """The arguments of the wide module standing for one call of a layer (its ops `nodes`, the
    values it takes from outside them `inputs`): the one value it takes; for a recurrent layer
    given its initial state, the input and the state as its op takes them (the wide module's
    STACKED_ARGS, an LSTM's state a tuple); None where neither is so."""
    if len(inputs) == 1:
        return (next(iter(inputs)),)
    op = next((n for n in nodes if n.target in _RECURRENT), None)
    if op is None:
        return None
    x, state = op.args[0], op.args[1]
    given = [x, *state] if isinstance(state, (list, tuple)) else [x, state]
    if set(given) != inputs:  # (an LSTM given one tensor as both h and c takes it twice)
        return None
    return (x, tuple(state) if isinstance(state, (list, tuple)) else state)


def _in_segments(graph: fx.Graph, holder: nn.Module, n: int, randomness: str, own: Set[fx.Node]) -> fx.Graph:
    """`graph` with its ops between swapped layers in segments: each lowered one that runs at
    once at every call, its lowered ops in `graph` itself; each other, a Segment (added to `holder`),
    which decides per call how it runs. `own`: the values each model's own at every call the
    capture takes (not one all share), of which a segment given one runs at once (Segment.forward).

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
    # the input's leaves in, the output's out, as forward flattens them: torch.export's graph flattened
    # them again, 21 of the 178 Python calls of a call of scripts/capture_paths.py's Mlp
    out = fx.Graph()
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
        stacked = [_given_stacked(a) for a in inputs]
        once, why = lower(nodes, inputs, outputs, stacked, randomness)
        if once is not None and not may_group(once) and own.intersection(inputs):
            # what Segment.forward would run at every call, without its call, its checks and a second
            # graph's: two Segments cost 150 to 230 us of a 1.1 to 1.4 ms call of scripts/capture_paths.py's
            # Mlp (N=16, hidden 64, one thread, loaded 2-core CPU)
            env.update(zip(outputs, _inlined(out, once.graph.graph, [n, *(env[a] for a in inputs)])))
            continue
        name = f"g{d}"
        holder.add_module(name, _segment(nodes, inputs, outputs, stacked, n, randomness, once, why))
        call = out.call_module(name, tuple(env[a] for a in inputs))
        for j, o in enumerate(outputs):
            env[o] = out.call_function(operator.getitem, (call, j))
    out.node_copy(graph.output_node(), env.__getitem__)
    return out


def _segment(
    nodes: List[fx.Node], inputs: List[fx.Node], outputs: List[fx.Node], stacked: List[bool], n: int,
    randomness: str, once: Optional[Lowered], why: str,
) -> Segment:  # fmt: skip
    """The ops `nodes` (reading `inputs`, giving `outputs`) as a Segment."""
    sub = fx.Graph()
    local = {a: sub.placeholder(a.name) for a in inputs}
    for node in nodes:
        local[node] = sub.node_copy(node, local.__getitem__)
    sub.output(tuple(local[o] for o in outputs))
    plain = all(isinstance(o.meta.get("val"), torch.Tensor) for o in outputs)
    return Segment(fx.GraphModule(nn.Module(), sub), stacked, plain, n, randomness, once, why)


def _inlined(out: fx.Graph, lowered: fx.Graph, given: List[Any]) -> Tuple[Any, ...]:
    """The ops of `lowered` copied into `out`, its inputs given `given` (in order): its outputs there."""
    env: Dict[fx.Node, Any] = dict(zip(lowered.find_nodes(op="placeholder"), given))
    for node in lowered.nodes:
        if node.op == "output":
            return tuple(fx.map_arg(node.args[0], env.__getitem__))
        if node.op != "placeholder":
            env[node] = out.node_copy(node, env.__getitem__)
    raise AssertionError("a graph without an output")


def _own_values(graph: fx.Graph, leaves: List[Any]) -> Set[fx.Node]:
    """The values of `graph` (n_axis marked) each model's own at every call its capture takes,
    given the wide input's `leaves`: an input tensor not shared (a capture is specialised to
    which are, capture.signature; the graph's inputs are the leaves, in order), a swapped layer's
    output, and a tensor held stacked."""
    inputs = zip(graph.find_nodes(op="placeholder"), leaves)
    own = {node for node, x in inputs if isinstance(x, torch.Tensor) and not is_shared(x)}
    layers = {node for node in graph.nodes if node.op == "call_module"}
    return own | layers | {node for node in graph.nodes if node.op == "get_attr" and is_stacked(node)}


def _given_stacked(value: fx.Node) -> bool:
    """Whether a segment is given `value` stacked: where it carries the N axis (n_axis), and where
    another segment gives it, which gives every output stacked (one all models share expanded)."""
    return is_stacked(value) or (value.op == "call_function" and value.target is not model_size)


def _copies_itself(node: fx.Node) -> bool:
    """Whether `node` copies into a buffer what an op in place on that buffer gave: the buffer
    itself. torch.export writes each buffer a forward updated back with copy_ (`self.c += y`: c.add_,
    then c.copy_(c)), which bumped the version of a tensor a product had saved, and backward raised
    "modified by an inplace operation", where the model alone trains."""
    if node.target is not torch.ops.aten.copy_.default or node.users:
        return False
    into, source = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or not isinstance(source.target, torch._ops.OpOverload):
        return False
    return source.target._schema.name.endswith("_") and source.args[0] is into


def _holders(model: nn.Module) -> Dict[int, Set[int]]:
    """Each tensor of `model` (by id) -> the modules (by id) that hold it as their own."""
    held: Dict[int, Set[int]] = {}
    for m in model.modules():
        for t in chain(m.parameters(recurse=False), m.buffers(recurse=False)):
            held.setdefault(id(t), set()).add(id(m))
    return held


# Modules whose forward reads their layers' tensors without calling the layers: torch's
# nn.MultiheadAttention hands out_proj's weight to F.multi_head_attention_forward. Its out_proj,
# an nn.Linear, was swapped and its weight then read outside its call: surgery refused every
# model holding one that torch.fx could not trace. Kept whole, as torch.fx keeps it.
_READS_ITS_LAYERS = (nn.MultiheadAttention,)


def _tied_outside(layer: nn.Module, holders: Dict[int, Set[int]]) -> bool:
    """Whether `layer` holds a tensor tied to a module outside it (GPT-2's lm_head holds its
    embedding's table; a layer registered under two names is one module, not tied). torch.export's
    graph reads such a tensor by one name, so the layer's call takes it as a second input, which
    its wide module cannot (surgery refused whole GPT-2, and a tied embedding and head). The
    layer runs as its ops, on the tensor held stacked once, as the rest of the graph does."""
    inside = {id(m) for m in layer.modules()}
    return any(holders[id(t)] - inside for t in chain(layer.parameters(), layer.buffers()))


def _within(paths: Sequence[str]) -> Tuple[str, ...]:
    """Prefixes of what lies inside the layers at `paths` (for str.startswith)."""
    return tuple(p + "." for p in paths)
