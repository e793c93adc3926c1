"""What surgery does with each op of a captured graph, given which of its values are stacked on
the N axis: the rules that both lowerings (surgery.py from torch.fx, exported.py from
torch.export) apply.

* an elementwise function (activations, +, *, ...) on stacked values of one rank runs on the
  stacked tensors at once: it cannot mix the models (`is_elementwise`, `Elementwise`);
* a shape query answers for one model, without the N axis (`ShapeQuery`); what a stacked tensor
  says of itself that each model's would say too (x.device) is not stacked (`is_model_fact`);
* a per-model layer given some arguments shared by all models gets them repeated (`Repeated`);
* anything else runs under vmap, call by call (`Vmapped`, `GetItem`), or, between the layers
  torch.export's graph swapped, in vmapped segments (`Segment`).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.func import vmap
from torch.utils._pytree import tree_map

from ..core.layout import Slot, prefixed, slots_of
from .functional import is_shared, model_size, tensors_only, vmap_dims, with_others

__all__ = [
    "ELEMENTWISE_MODULES",
    "Vmapped",
    "Elementwise",
    "GetItem",
    "ShapeQuery",
    "Repeated",
    "Segment",
    "AtOnce",
    "at_once",
    "leaf_flags",
    "constants_are_numbers",
    "is_shape_query",
    "is_model_fact",
    "is_elementwise",
    "method_call",
]


# Functions that act on each element on its own: applied to stacked tensors of one rank, they
# give what N separate calls give.
_ELEMENTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.tanh, torch.sigmoid, torch.relu,
    F.gelu, F.relu, F.silu, F.leaky_relu, F.elu, F.tanh, F.sigmoid, F.softplus, F.mish, F.hardswish,
}
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "neg", "exp", "tanh", "sigmoid", "relu", "pow"}
ELEMENTWISE_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Identity)


class Vmapped(nn.Module):
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


class Elementwise(Vmapped):
    """An elementwise call on several stacked values: at once when they share a rank (broadcasting
    then pairs model i with model i), else vmapped."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ranks = {x.dim() for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)}
        return self.fn(*args, **kwargs) if len(ranks) == 1 else super().forward(*args, **kwargs)


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


def constants_are_numbers(node: fx.Node) -> bool:
    leaves: List[Any] = []
    tree_map(leaves.append, (node.args, node.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
    return all(isinstance(a, (fx.Node, int, float, bool, str, type(None))) for a in leaves)


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
    if node.op == "call_function":
        return node.target in _ELEMENTWISE
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    return False


def _with_ones(stacked: torch.Tensor, rank: int) -> torch.Tensor:
    """A stacked tensor of one model's rank below `rank` with 1s after its N axis."""
    return stacked.reshape(stacked.shape[0], *[1] * (rank + 1 - stacked.dim()), *stacked.shape[1:])


def _as_stacked(out: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """An output of one model's `rank` as N stacked: the 1s `_with_ones` put after the N axis
    merged into it; an output computed from no model's own value, expanded."""
    if out.dim() == rank:
        return out.expand(n, *out.shape)
    return out.flatten(0, out.dim() - 1 - rank)


def method_call(name: str) -> Callable[..., Any]:
    return lambda obj, *a, **k: getattr(obj, name)(*a, **k)


_aten = torch.ops.aten
# aten ops of a captured graph that act on each element on its own (see is_elementwise)
_ELEMENTWISE_ATEN = {
    _aten.add.Tensor, _aten.add.Scalar, _aten.sub.Tensor, _aten.sub.Scalar, _aten.rsub.Scalar,
    _aten.mul.Tensor, _aten.mul.Scalar, _aten.div.Tensor, _aten.div.Scalar, _aten.neg.default,
    _aten.exp.default, _aten.log.default, _aten.sqrt.default, _aten.rsqrt.default, _aten.pow.Tensor_Scalar,
    _aten.tanh.default, _aten.sigmoid.default, _aten.relu.default, _aten.gelu.default, _aten.silu.default,
    _aten.erf.default, _aten.to.dtype, _aten.type_as.default,
}  # fmt: skip
_KEPT_RANK_REDUCTIONS = {_aten.mean.dim, _aten.sum.dim_IntList}
# ops that draw nothing at random: computed once on a value all models share, as each model would
_DETERMINISTIC_VIEWS = {
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.view.default, _aten.reshape.default, _aten.transpose.int,
    _aten.permute.default, _aten.expand.default, _aten.slice.Tensor, _aten.select.int, _aten.contiguous.default,
}  # fmt: skip


def _keeps_the_models_apart(node: fx.Node) -> bool:
    """Whether `node`, given each model's values stacked on a new leading axis (those of lower
    rank with 1s after it), computes each model's result and keeps every value's rank: an
    elementwise op (broadcasting aligns the trailing dimensions, as it does for one model), a
    reduction over dimensions counted from the end that keeps them, dropout where it is off."""
    if node.target in _ELEMENTWISE_ATEN:
        return True
    if node.target in _KEPT_RANK_REDUCTIONS:
        dims, keep = node.args[1] if len(node.args) > 1 else None, node.args[2] if len(node.args) > 2 else False
        counted_from_the_end = isinstance(dims, (list, tuple)) and all(isinstance(d, int) and d < 0 for d in dims)
        return counted_from_the_end and bool(dims) and keep is True
    return node.target is _aten.dropout.default and len(node.args) > 2 and node.args[2] is False


class AtOnce(NamedTuple):
    """How a segment runs once on the stacked values (at_once): every model's tensor gets the
    rank `rank` (1s after the N axis), each output has its rank `ranks` for one model, and the
    inputs at `shared_only` must be shared by all models (ops that do not keep models apart read them)."""

    rank: int
    ranks: Tuple[int, ...]
    shared_only: FrozenSet[int]


def at_once(nodes: List[fx.Node], inputs: List[fx.Node], outputs: List[fx.Node]) -> Optional[AtOnce]:
    """Whether a segment can run once on the stacked values, without vmap: each op keeps the models
    apart (`_keeps_the_models_apart`) or reads only values all models share (a RoPE table's
    unsqueeze); None where not, or where one model's ranks are not known.

    vmap's own cost, about 70 us a call on the 2-core CPU (silu(x) * x on 16 x [2, 6, 128]: 18 us
    at once, 90 us vmapped), kept surgery behind vmap of the whole model on small layers, whose
    stretches between swapped layers are often this simple (an MLP's activation, a residual add,
    an RMSNorm): at N=16, hidden 32, surgery was at least as fast as vmap on 5 of 16 layers,
    and on 12 once they ran at once (scripts/real_modules.py, pinned, 2026-11-27)."""
    where = {a: frozenset([i]) for i, a in enumerate(inputs)}  # the inputs each value depends on
    shared_only: FrozenSet[int] = frozenset()
    for node in nodes:
        if node.op != "call_function":
            return None
        where[node] = frozenset().union(*(where.get(a, frozenset()) for a in node.all_input_nodes))
        if not _keeps_the_models_apart(node):
            if node.target not in _DETERMINISTIC_VIEWS:
                return None
            shared_only |= where[node]
    vals = [n.meta.get("val") for n in (*inputs, *nodes)]
    if not all(isinstance(v, (torch.Tensor, int, float, bool, torch.SymInt)) for v in vals):
        return None
    # A model's own 0-dim tensor, stacked, has a dimension, and would raise the dtype of what it
    # meets (float32 x a 0-dim float64 is float32 for one model, float64 stacked): where each
    # model has its own (a float64 buffer, an fp32 temperature beside bf16), vmap runs the segment.
    scalars = {i for i, v in enumerate(vals[: len(inputs)]) if isinstance(v, torch.Tensor) and v.dim() == 0}
    shared_only |= scalars
    outs = [o.meta.get("val") for o in outputs]
    ranks = tuple(v.dim() for v in outs if isinstance(v, torch.Tensor))
    if len(ranks) != len(outs):
        return None
    return AtOnce(max((v.dim() for v in vals if isinstance(v, torch.Tensor)), default=0), ranks, shared_only)


class Segment(nn.Module):
    """Ops between swapped layers, one vmapped call over the stacked values (`stacked`: which of
    its arguments are; a tensor passed once for all models, expanded, goes in once). `plain`:
    its outputs are tensors, which vmap returns as they are (a tree of them takes tensors_only,
    30 us a call). `once`: where its ops keep the models apart (at_once), it runs once on the
    stacked values, without vmap."""

    def __init__(
        self,
        fn: fx.GraphModule,
        stacked: List[bool],
        plain: bool,
        n: int,
        randomness: str,
        once: Optional[AtOnce] = None,
    ):
        super().__init__()
        self.fn, self.stacked, self.plain, self.n, self.randomness = fn, stacked, plain, n, randomness
        self.once = once

    def forward(self, *values: Any) -> Any:
        mapped = [st and isinstance(v, torch.Tensor) and not is_shared(v) for v, st in zip(values, self.stacked)]
        values = tuple(v[0] if st and is_shared(v) else v for v, st in zip(values, self.stacked))
        if not any(mapped):  # nothing here is any model's own: computed once, shared by all
            out = self.fn(*values)
            return tree_map(lambda t: t.expand(self.n, *t.shape) if isinstance(t, torch.Tensor) else t, out)
        once = self.once
        if once is not None and not any(mapped[i] for i in once.shared_only):
            return self._at_once(values, mapped, once)
        dims = tuple(0 if m else None for m in mapped)
        if self.plain:
            return vmap(self.fn, in_dims=dims, randomness=self.randomness)(*values)
        kept: List[Any] = []
        out = vmap(tensors_only(self.fn, kept), in_dims=dims, randomness=self.randomness)(*values)
        return with_others(out, kept)

    def _at_once(self, values: Tuple[Any, ...], mapped: List[bool], once: AtOnce) -> Tuple[Any, ...]:
        """The segment once on the stacked values: each model's tensors get 1s after the N axis up
        to the segment's highest rank, so broadcasting aligns every model's trailing dimensions as
        it does for one; each output loses those 1s again, and one that no model's own value
        reached is expanded."""
        aligned = tuple(_with_ones(v, once.rank) if m else v for v, m in zip(values, mapped))
        outputs = self.fn(*aligned)
        return tuple(_as_stacked(o, r, self.n) for o, r in zip(outputs, once.ranks))
