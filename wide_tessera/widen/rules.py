"""What surgery does with each op of a captured graph, given which of its values are stacked on
the N axis (n_axis.py marks them): the rules that both lowerings (surgery.py from torch.fx, exported.py from
torch.export) apply.

* an elementwise function (activations, +, *, ...) on stacked values of one rank runs on the
  stacked tensors at once: it cannot mix the models (`is_elementwise`, `Elementwise`);
* a shape query answers for one model, without the N axis (`ShapeQuery`); what a stacked tensor
  says of itself that each model's would say too (x.device) is not stacked (`is_model_fact`);
* a per-model layer given some arguments shared by all models gets them repeated (`Repeated`);
* a layer all models hold as one frozen layer runs once over the N batches (`Folded`);
* anything else runs under vmap, call by call (`Vmapped`, `GetItem`), or, between the layers
  torch.export's graph swapped, in segments (`Segment`), run at once where lowering.py has a
  rule for each of their ops, else vmapped.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn
from torch.func import vmap
from torch.utils._pytree import tree_leaves, tree_map

from ..core.environment import cpu_l2_bytes
from ..core.layout import SHARED, Slot, held_once, prefixed, slots_of
from .lowering import Lowered, draws, pointwise
from .stacked import is_shared, model_size, with_ones
from .vmapping import EMBEDDINGS, tensors_only, under_vmap, vmap_dims, with_others

__all__ = [
    "ELEMENTWISE_MODULES",
    "Vmapped",
    "Folded",
    "layer_held_once",
    "Elementwise",
    "GetItem",
    "ShapeQuery",
    "Repeated",
    "Segment",
    "may_group",
    "leaf_flags",
    "alone_among_numbers",
    "is_shape_query",
    "is_model_fact",
    "is_elementwise",
    "method_call",
]


# Python's operators by the ATen op each calls on tensors, where the names differ
_OPERATOR_OPS = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "invert": "bitwise_not",
                 "and_": "bitwise_and", "or_": "bitwise_or", "xor": "bitwise_xor"}  # fmt: skip
# Where torch's own functions live (a function of the user's, torch.fx.wrap'ed, is never taken by its
# name; nor one of a package whose name begins "torch", torch_geometric's or torchaudio's)
_TORCH_MODULES = ("torch", "_operator")
ELEMENTWISE_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Identity)


class Vmapped(nn.Module):
    """A call that may mix a model's values: vmapped over the stacked arguments (`mask`: which)."""

    def __init__(self, fn: Callable[..., Any], mask: Any, randomness: str):
        super().__init__()
        self.fn, self.randomness, self.pads = fn, randomness, fn in EMBEDDINGS
        args, kwargs = tree_map(lambda stacked: 0 if stacked else None, mask)
        # shaped as the call receives them: fx keeps its arguments in immutable lists and dicts
        self.in_dims = (tuple(_plain(a) for a in args), {k: _plain(v) for k, v in kwargs.items()})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.fn
        values, dims = _fit(self.in_dims, (args, kwargs))
        kept: List[Any] = []
        with under_vmap(self.randomness, self.pads):
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


class Folded(Vmapped):
    """A layer every model holds as one frozen layer (each of its tensors `held_once`: a LoRA
    base, a frozen backbone's), held once and called once for the N batches: an nn.Linear on
    the stacked input as it is (it acts on the last axis, and the N axis folds into its rows:
    one GEMM), any other under vmap with its tensors unmapped; given only values all models
    share, once, its output theirs too."""

    def __init__(self, layer: nn.Module, mask: Any, randomness: str):
        super().__init__(layer, mask, randomness)
        self._names = list(layer.state_dict())

    def model_slots(self) -> Dict[str, Slot]:
        return {f"fn.{k}": Slot(k, SHARED) for k in self._names}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        stacked = tree_leaves(self.in_dims)  # (None, an argument all share, is no leaf)
        if not stacked or (type(self.fn) is nn.Linear and self.in_dims == ((0,), {})):
            return self.fn(*args, **kwargs)
        return super().forward(*args, **kwargs)


def layer_held_once(subs: Sequence[nn.Module]) -> bool:
    """Whether `subs` (a submodule of each model) are one frozen layer: parameters, each held
    once (core.layout.held_once), and no buffer (each model's)."""
    names = [name for name, _ in subs[0].named_parameters()]
    if not names or any(True for _ in subs[0].buffers()):
        return False
    return all(held_once([s.get_parameter(name) for s in subs]) for name in names)


class Elementwise(Vmapped):
    """An elementwise call on stacked values and values all models share: at once, each stacked
    one given 1s after N up to the call's highest rank for one model (as lowering.py's elementwise
    rule does), so broadcasting pairs model i with model i and aligns each model's trailing
    dimensions as for one. A shared tensor of the stack's rank broadcast against its N axis:
    h * torch.arange(3.0).view(3, 1, 1) gave each of 3 models [4, 8] where one gives [3, 4, 8].
    A model's own 0-dim tensor of another dtype than the rest (it would promote, stacked) is vmapped."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = [*args, *kwargs.values()]
        dims = [*self.in_dims[0], *self.in_dims[1].values()]
        if not all(d in (0, None) for d in dims):
            return super().forward(*args, **kwargs)
        tensors = [(x, d == 0) for x, d in zip(flat, dims) if isinstance(x, torch.Tensor)]
        if all(stacked for _, stacked in tensors) and len({x.dim() for x, _ in tensors}) == 1:
            return self.fn(*args, **kwargs)  # models' values of one rank (a gate times its input): as they are
        rank = max(x.dim() - stacked for x, stacked in tensors)
        if any(stacked and x.dim() == 1 and {x.dtype} != {t.dtype for t, _ in tensors} for x, stacked in tensors):
            return super().forward(*args, **kwargs)
        lifted = [with_ones(x, rank) if d == 0 and isinstance(x, torch.Tensor) else x for x, d in zip(flat, dims)]
        return self.fn(*lifted[: len(args)], **dict(zip(kwargs, lifted[len(args) :])))


class GetItem(Vmapped):
    """x[i]: one part of a stacked tuple or list as it is; an index into a stacked tensor, vmapped."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(args[0], (tuple, list)):
            return args[0][args[1]]
        return super().forward(*args, **kwargs)


class ShapeQuery(nn.Module):
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


class Repeated(nn.Module):
    """A per-model layer given some arguments that are the same for every model (`mask`: which
    of the call's (args, kwargs) are stacked): those repeated N times, by keyword too (a causal
    mask made in forward and given as attn_mask= was mapped over its own first axis as if it were
    N models' masks: torch's error, or, where that axis was N, each model another's)."""

    def __init__(self, layer: nn.Module, mask: Any, n: int):
        super().__init__()
        self.layer, self.n = layer, n
        self.mask = (tuple(mask[0]), dict(mask[1]))  # fx keeps its arguments in immutable lists and dicts

    def model_slots(self) -> Dict[str, Slot]:
        return prefixed(slots_of(self.layer), "layer", "")

    def _repeated(self, x: Any, stacked: Any) -> Any:
        """`x` with each tensor `stacked` says is shared repeated, within a tuple too (an LSTM's
        (h0, c0) made in forward: torch's error)."""
        if isinstance(stacked, (tuple, list)) and isinstance(x, (tuple, list)):
            return type(x)(self._repeated(a, st) for a, st in zip(x, stacked))
        return x if stacked is not False or not isinstance(x, torch.Tensor) else x.expand(self.n, *x.shape)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(self._repeated(x, st) for x, st in zip(args, self.mask[0]))
        return self.layer(*args, **{k: self._repeated(x, self.mask[1].get(k)) for k, x in kwargs.items()})


def _plain(tree: Any) -> Any:
    if isinstance(tree, list):
        return [_plain(x) for x in tree]
    if isinstance(tree, tuple):
        return tuple(_plain(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def leaf_flags(mask: Any) -> List[bool]:
    out: List[bool] = []
    tree_map(out.append, mask)
    return out


def alone_among_numbers(node: fx.Node, mask: Any) -> bool:
    """Whether `node` takes one stacked value and, besides, only numbers written in the graph:
    an elementwise call then runs on the stack as it is. A value the graph computes may be a
    tensor all models share, which it would broadcast against the stack's N axis (see Elementwise)."""
    leaves: List[Any] = []
    tree_map(leaves.append, (node.args, node.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
    flags = leaf_flags(mask)
    numbers = (int, float, bool, str, type(None))
    return sum(flags) == 1 and all(st or isinstance(a, numbers) for a, st in zip(leaves, flags))


def is_shape_query(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target is getattr and len(node.args) == 2 and node.args[1] in ("shape", "ndim")
    return node.op == "call_method" and node.target in ("size", "dim") and not node.kwargs


# What a stacked tensor says of itself that each model's tensor would say too. As stacked values,
# a constant made on x.device (torch.tensor([0.5], device=x.device)) was vmapped over no tensor
# and failed the surgery strategy.
_MODEL_FACT_ATTRIBUTES = ("device", "dtype", "is_cuda", "layout")


_MODEL_FACT_METHODS = ("is_floating_point", "is_complex", "element_size", "get_device")


def is_model_fact(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target is getattr and len(node.args) == 2 and node.args[1] in _MODEL_FACT_ATTRIBUTES
    return node.op == "call_method" and node.target in _MODEL_FACT_METHODS and len(node.args) == 1


def is_elementwise(node: fx.Node) -> bool:
    """Whether a torch.fx call acts on each element on its own, so that applied to stacked tensors
    of one rank it gives what N separate calls give: the ATen op it names (a tensor method's name,
    or a torch or operator function's) is pointwise in every form a tensor call may take
    (lowering.pointwise, the test torch.export's stretches are lowered by)."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function" and str(getattr(node.target, "__module__", None)).split(".")[0] in _TORCH_MODULES:
        name = getattr(node.target, "__name__", "")
        name = _OPERATOR_OPS.get(name, name)
    else:
        return False
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    ops = [getattr(packet, overload) for overload in packet.overloads()]  # type: ignore[no-untyped-call]
    # every form a tensor call may take (its first argument a tensor; the `out=` ones write): torch.max
    # is a reduction in one form, pointwise in another, and where(cond) alone gives indices
    forms = [op for op in ops if _first_is_tensor(op) and not op._schema.is_mutable]
    return bool(forms) and all(pointwise(op) for op in forms)


def _first_is_tensor(op: torch._ops.OpOverload) -> bool:
    arguments = op._schema.arguments
    return bool(arguments) and str(arguments[0].type) == "Tensor"


def method_call(name: str) -> Callable[..., Any]:
    """A tensor method as a function, named as the method (what_ran counts calls under vmap by name)."""

    def call(obj: Any, *a: Any, **k: Any) -> Any:
        return getattr(obj, name)(*a, **k)

    call.__name__ = call.__qualname__ = name
    return call


# A stretch run at once reads and writes the N models' values whole at each op; N separate
# calls each do it on one model's, which stays in the core's L2 cache from op to op. Where the
# stacked values are many times L2 and many ops pass over them, the stretch runs on groups of
# models whose values fit L2 instead. GPT2Block at hidden 512, N=16 (its MLP's 8 elementwise
# ops over a 2 MB activation a model, 32 MB stacked): 0.65x of the loop at once, 0.93x in
# groups (0.68x and 0.90x at hidden 256; PhiDecoderLayer at 512: 0.80x and 0.92x); groups of
# L2/8 to L2 measured alike. A stretch of 1 or 2 such ops (T5's ReLU, Llama's SiLU-gate) lost
# 4% to 8% grouped, and stacked values under 8 MB gained nothing (pinned, one thread, 2 MB of
# L2, 2026-11-27).
L2_BYTES = cpu_l2_bytes() or 2 << 20
MANY_PASSES = 4


def may_group(once: Lowered) -> bool:
    """Whether the lowered stretch `once` may run in groups of models (where its values outgrow
    L2 on a CPU): whether many of its ops pass over its largest values; else it runs at once."""
    return once.passes >= MANY_PASSES


def _own(value: Any) -> bool:
    """Whether `value` holds a model's own tensor: one not shared (a GRU's output and state, a tuple, are)."""
    if isinstance(value, (tuple, list)):
        return any(_own(v) for v in value)
    return isinstance(value, torch.Tensor) and not is_shared(value)


class Segment(nn.Module):
    """Ops between swapped layers, one vmapped call over the stacked values (`stacked`: which of
    its arguments are; a tensor passed once for all models, expanded, goes in once). `plain`:
    its outputs are tensors, which vmap returns as they are (a tree of them takes tensors_only,
    30 us a call). `once`: the same ops lowered to run once on the stacked values, without vmap,
    where every op has a rule (lowering.lower); `why_vmapped` says which op has none."""

    def __init__(
        self,
        fn: fx.GraphModule,
        stacked: List[bool],
        plain: bool,
        n: int,
        randomness: str,
        once: Optional[Lowered] = None,
        why_vmapped: str = "",
    ):
        super().__init__()
        self.fn, self.stacked, self.plain, self.n, self.randomness = fn, stacked, plain, n, randomness
        self.once, self.why_vmapped = once, why_vmapped
        # each model draws its own from a value they all share (dropout of a shared input):
        # computed once, it drew one mask for all
        self.draws_each = randomness == "different" and any(draws(node) for node in fn.graph.nodes)
        self.pads = any(node.target in EMBEDDINGS for node in fn.graph.nodes)

    def forward(self, *values: Any) -> Any:
        each = self.draws_each
        mapped = [st and (_own(v) or each and isinstance(v, torch.Tensor)) for v, st in zip(values, self.stacked)]
        if self.once is not None and any(mapped):
            return self._at_once(self.once, values)
        values = tuple(v[0] if st and is_shared(v) and not m else v for v, st, m in zip(values, self.stacked, mapped))
        if not any(mapped):  # nothing here is any model's own: computed once, shared by all
            out = self.fn(*values)
            return tree_map(lambda t: t.expand(self.n, *t.shape) if isinstance(t, torch.Tensor) else t, out)
        dims = tuple(0 if m else None for m in mapped)
        kept: List[Any] = []
        with under_vmap(self.randomness, self.pads):
            if self.plain:
                return vmap(self.fn, in_dims=dims, randomness=self.randomness)(*values)
            out = vmap(tensors_only(self.fn, kept), in_dims=dims, randomness=self.randomness)(*values)
        return with_others(out, kept)

    def _at_once(self, once: Lowered, values: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """The lowered stretch on the stacked values: at once, or, where many of its ops pass over
        values far larger than L2 on a CPU, in groups of models whose values fit it (L2_BYTES)."""
        x = values[once.scale] if once.scale is not None else None
        group = self.n
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and may_group(once):
            per_model = once.growth * x[0].numel() * x.element_size()
            if per_model * self.n > 4 * L2_BYTES:
                group = int(min(self.n, max(1, L2_BYTES // per_model)))
        if group >= self.n:
            return tuple(once.graph(self.n, *values))
        parts = []
        for i in range(0, self.n, group):
            part = (tree_map(lambda t, i=i: t[i : i + group], v) if s else v for v, s in zip(values, once.sliced))
            parts.append(once.graph(min(group, self.n - i), *part))
        return tuple(torch.cat(p) if isinstance(p[0], torch.Tensor) else p[0] for p in zip(*parts))
