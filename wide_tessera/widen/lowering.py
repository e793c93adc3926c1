"""A stretch of a captured graph between swapped layers, lowered to run once on the N models'
stacked values, without vmap.

Each value's layout is data: a tensor is either *stacked* (each model's tensor on a new leading
N axis; a list of them from a split) or *shared* (one value all models read: a constant, a size,
a RoPE table computed once), as n_axis.mark marked it in `node.meta`; a stretch's inputs are
as the segment gives them (another segment's output comes stacked, a shared one expanded). A registry
of rules keyed by aten op (`RULES`) says how an op runs on stacked operands: an elementwise op
gives each stacked operand of lower rank 1s after its N axis, so broadcasting aligns every
model's trailing dimensions as it does for one; an op with dimension arguments (transpose,
softmax, slice, cat, ...) counts them one axis on; a view gets N in front of its shape; a
matmul broadcasts its batch dimensions as an elementwise op does; attention folds N into the
batch. An op on shared values only is computed once, as each model would. An op with no rule,
or a call its rule cannot take, leaves the stretch to vmap, and `lower` says which.

Why not vmap: vmap's own cost is about 70 us a call on the 2-core CPU (silu(x) * x on
16 x [2, 6, 128]: 18 us at once, 90 us vmapped), and grows with the ops it runs: a Llama
layer's attention stretch, 40 ops, cost more under vmap than its 7 swapped linears at hidden
32 (scripts/real_modules.py, pinned, 2026-11-27: surgery 0.90x of vmap of the whole layer).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from .n_axis import stacked as is_stacked
from .stacked import with_ones

__all__ = ["RULES", "Lowered", "draws", "lower", "pointwise"]

aten = torch.ops.aten
Rule = Callable[["_Lowering", fx.Node], Optional[fx.Node]]


class Lowered(NamedTuple):
    """A stretch lowered onto stacked values: `graph(n, *values)` runs it for n models' values
    at once; `sliced` says which of its inputs are the models' own tensors or tuples of them (the
    ones a group of models takes its part of); `growth`: how many times the elements of its largest input
    that is not a parameter (`scale`, None where none is) one model's largest value holds, at
    the capture's sizes (GPT-2's MLP activation: 4x its input); `passes`: its elementwise ops
    over values of at least half that size (GPT-2's tanh GELU: 8)."""

    graph: fx.GraphModule
    sliced: Tuple[bool, ...]
    scale: Optional[int]
    growth: float
    passes: int


def lower(
    nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node], stacked: Sequence[bool],
    randomness: str,
) -> Tuple[Optional[Lowered], str]:  # fmt: skip
    """The stretch `nodes` (reading `inputs`, of which `stacked` are the models' own, giving
    `outputs`) as a graph that runs once on the stacked values and returns every output stacked;
    or (None, why not): the first op no rule takes."""
    lo = _Lowering(randomness, inputs)
    lo.n = lo.graph.placeholder("n")
    for a, st in zip(inputs, stacked):
        lo.env[a] = lo.graph.placeholder(a.name)
        val = a.meta.get("val")
        if st and _ranks(val) is not None:  # a tensor, or a tuple of them (a swapped GRU's output and state)
            lo.given.add(a)
        elif st and ("val" not in a.meta or isinstance(val, (tuple, list))):
            return None, f"{a.name}'s layout is not known"
    for node in nodes:
        why = lo.add(node)
        if why:
            return None, why
    outs = []
    for o in outputs:
        val = o.meta.get("val")
        if (lo.stacked(o) and isinstance(_ranks(val), tuple)) or not isinstance(
            val, (torch.Tensor, int, float, bool, torch.SymInt)
        ):
            return None, f"{o.name} leaves the stretch as a {type(val).__name__}"
        outs.append(lo.stacked_value(o) if isinstance(val, torch.Tensor) else lo.env[o])
    lo.graph.output(tuple(outs))
    sliced = tuple(a in lo.given for a in inputs)
    own = [i for i, a in enumerate(inputs) if a in lo.given and a.op != "get_attr"]
    values = [i for i in own if isinstance(_ranks(inputs[i].meta["val"]), int)]
    scale = max(values, key=lambda i: _elements(inputs[i]), default=None)
    largest = max((_elements(a) for a in (*(inputs[i] for i in values), *nodes) if lo.stacked(a)), default=0)
    growth = largest / _elements(inputs[scale]) if scale is not None and _elements(inputs[scale]) else 0.0
    passes = sum(_rule(a.target) is _elementwise and 2 * _elements(a) >= largest for a in nodes if lo.stacked(a))
    return Lowered(fx.GraphModule(nn.Module(), lo.graph), sliced, scale, growth, passes), ""


def _elements(node: fx.Node) -> int:
    """One model's number of elements of `node`'s tensor at the capture's sizes (0: not a tensor)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    count = val.numel()
    return count if isinstance(count, int) else int(count.node.hint or 0)


class _Lowering:
    """The graph being built (`graph`, `env`: an op of the stretch -> its value there) and the
    layout of each value: an input is stacked where it is `given` so, an op where n_axis marked it."""

    def __init__(self, randomness: str, inputs: Sequence[fx.Node]):
        self.randomness = randomness
        self.n: Any = None  # the graph's input: how many models' values it is given
        self.graph = fx.Graph()
        self.env: Dict[fx.Node, fx.Node] = {}
        self.inputs = set(inputs)
        self.given: Set[fx.Node] = set()  # the inputs given stacked

    def add(self, node: fx.Node) -> str:
        """`node` lowered into the graph; why not, where it cannot be."""
        name = getattr(node.target, "__name__", str(node.target))
        if node.op != "call_function":
            return f"{node.op} {name}"
        if not self.stacked(node):  # no model's own value reaches it
            if draws(node):  # computed once, it would draw once for all models
                return f"{name} draws at random from no model's value"
            self.env[node] = self.graph.node_copy(node, self.env.__getitem__)
            return ""
        rule = _rule(node.target)
        ranks = _ranks(node.meta.get("val"))
        if rule is None:
            return f"{name} has no rule"
        out = rule(self, node) if ranks is not None else None
        if out is None:
            return f"{name} has no rule for its arguments here"
        self.env[node] = out
        return ""

    def stacked(self, a: Any) -> bool:
        if not isinstance(a, fx.Node):
            return False
        return a in self.given if a in self.inputs else is_stacked(a)

    def value(self, a: Any) -> fx.Node:
        """`a` (an op of the stretch or one of its inputs) on the new graph."""
        return self.env[a]

    def rank(self, a: Any) -> int:
        """One model's rank of the tensor `a`, stacked or shared."""
        return int(a.meta["val"].dim())

    def new(self, tree: Any) -> Any:
        return fx.map_arg(tree, self.env.__getitem__)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self.graph.call_function(fn, args, kwargs)

    def lifted(self, a: Any, rank: int) -> Any:
        """`a` on the new graph; a stacked tensor of a lower rank than `rank` with 1s after its N axis."""
        if self.stacked(a) and self.rank(a) < rank:
            return self.call(with_ones, self.env[a], rank)
        return self.new(a)

    def stacked_value(self, a: Any) -> fx.Node:
        """The tensor `a` stacked: a shared one expanded to N (a view: no copy)."""
        return self.env[a] if self.stacked(a) else self.call(_expanded, self.env[a], self.n)

    def with_arguments(self, node: fx.Node, **changed: Any) -> fx.Node:
        """`node`'s call on the new values, with the arguments named in `changed` replaced."""
        args, kwargs = list(self.new(node.args)), dict(self.new(node.kwargs))
        for name, value in changed.items():
            at = _position(node, name)
            if at < len(args):
                args[at] = value
            else:
                kwargs[name] = value
        return self.graph.call_function(node.target, tuple(args), kwargs)  # type: ignore[arg-type]


def _expanded(shared: torch.Tensor, n: int) -> torch.Tensor:
    return shared.expand(n, *shared.shape)


def _ranks(val: Any) -> Any:
    """One model's rank of a tensor; a tuple of them, nested as the value is, for a tuple of tensors."""
    if isinstance(val, torch.Tensor):
        return val.dim()
    if isinstance(val, (list, tuple)) and val:
        ranks = tuple(_ranks(v) for v in val)
        return None if None in ranks else ranks
    return None


def draws(node: fx.Node) -> bool:
    """Whether `node` draws at random (a dropout that is off draws nothing)."""
    if node.target is aten.dropout.default:
        return _argument(node, "train") is not False
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _position(node: fx.Node, name: str) -> int:
    return next(i for i, a in enumerate(node.target._schema.arguments) if a.name == name)  # type: ignore[union-attr]


def _argument(node: fx.Node, name: str) -> Any:
    """The argument `name` of an aten op's call, given or by default."""
    at = _position(node, name)
    if at < len(node.args):
        return node.args[at]
    default = node.target._schema.arguments[at]  # type: ignore[union-attr]
    return node.kwargs.get(name, default.default_value if default.has_default_value() else None)


def _args(node: fx.Node) -> Any:
    return node.args


def _tensors(node: fx.Node) -> List[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


# --- the rules ------------------------------------------------------------------------------


def _elementwise(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """Each stacked operand at the highest rank of the call's tensors (1s after N): broadcasting
    then pairs model i with model i, and aligns each model's trailing dimensions as for one.
    A model's own 0-dim tensor would, stacked, have a dimension and raise the dtype of what it
    meets (float32 x a 0-dim float64 is float32 for one model): then no rule (an adversarial
    the next swapped layer refused the mixed dtypes)."""
    if not isinstance(node.meta.get("val"), torch.Tensor):  # frexp is pointwise and gives two
        return None
    tensors = _tensors(node)
    rank = max(lo.rank(a) for a in tensors)
    dtype = node.meta["val"].dtype
    if any(lo.stacked(a) and lo.rank(a) == 0 and a.meta["val"].dtype != dtype for a in tensors):
        return None
    args, kwargs = fx.map_arg((_args(node), node.kwargs), lambda a: lo.lifted(a, rank))
    return lo.graph.call_function(node.target, args, kwargs)  # type: ignore[arg-type]


def _moved(d: Any, rank: int) -> Optional[int]:
    """A model's dimension `d` of a tensor of `rank` as the stacked tensor's."""
    return d % rank + 1 if isinstance(d, int) and not isinstance(d, bool) and -rank <= d < rank else None


def _dims(*names: str, extra: int = 0) -> Rule:
    """An op on one stacked tensor whose arguments `names` are dimensions (or lists of them),
    counted one axis on; `extra`: 1 where a dimension may name one past the input's rank (unsqueeze)."""

    def rule(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
        x = _args(node)[0]
        if not lo.stacked(x) or any(lo.stacked(a) for a in node.all_input_nodes if a is not x):
            return None
        rank = lo.rank(x) + extra
        changed = {}
        for name in names:
            d = _argument(node, name)
            moved = [_moved(i, rank) for i in d] if isinstance(d, (list, tuple)) else _moved(d, rank)
            if moved is None or (isinstance(moved, list) and (None in moved or not moved)):
                return None
            changed[name] = moved
        return lo.with_arguments(node, **changed)

    return rule


def _permute(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """A permutation of a model's dimensions, the N axis kept in front (without it, a crash)."""
    x, dims = _args(node)[0], _args(node)[1]
    moved = [_moved(d, lo.rank(x)) for d in dims]
    return None if None in moved else lo.call(aten.permute.default, lo.value(x), [0, *moved])


def _type_as(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """x cast to other's dtype: x's shape, whatever other's (lifted as an operand, a model's
    vector took a matrix's rank and the next op's dimensions went astray)."""
    x, other = _args(node)[:2]
    return lo.call(aten.type_as.default, lo.stacked_value(x), lo.new(other))


def _as_is(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """An op on its first argument alone whose meaning does not depend on the rank (contiguous, clone)."""
    if any(lo.stacked(a) for a in node.all_input_nodes[1:]) or node.kwargs.get("memory_format") not in (
        None, torch.contiguous_format, torch.preserve_format,
    ):  # fmt: skip
        return None
    return lo.with_arguments(node)


def _view(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """A view or reshape: N in front of the shape. Reshape, as a stacked input that every model
    shares at run time (expanded, stride 0 on N) may not be viewed as one model's was."""
    x, shape = _args(node)[0], _args(node)[1]
    return lo.call(aten.reshape.default, lo.value(x), [lo.n, *lo.new(shape)])


def _expand(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    x, size = _args(node)[0], _args(node)[1]
    return lo.call(aten.expand.default, lo.lifted(x, len(size)), [lo.n, *lo.new(size)])


def _transposed(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """t(): a model's matrix transposed; a vector or a scalar as it is."""
    x = _args(node)[0]
    return lo.call(aten.transpose.int, lo.value(x), 1, 2) if lo.rank(x) == 2 else lo.value(x)


def _joined(extra: int) -> Rule:
    """cat (extra 0) and stack (1): every tensor stacked (a shared one expanded), the dimension one on."""

    def rule(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
        tensors = _args(node)[0]
        ranks = {lo.rank(t) for t in tensors}
        if len(ranks) != 1:  # cat's 1-d empty tensors of another rank
            return None
        d = _moved(_argument(node, "dim"), ranks.pop() + extra)
        if d is None:
            return None
        return lo.with_arguments(node, tensors=[lo.stacked_value(t) for t in tensors], dim=d)

    return rule


def _matmul(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """mm, bmm, matmul of matrices or batches of them: their batch dimensions broadcast as an
    elementwise op's do, so each stacked operand gets the higher rank (a vector's matmul is not this)."""
    a, b = _args(node)[0], _args(node)[1]
    rank = max(lo.rank(a), lo.rank(b))
    if min(lo.rank(a), lo.rank(b)) < 2:
        return None
    return lo.call(torch.matmul, lo.lifted(a, rank), lo.lifted(b, rank))


def _addmm(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """bias + a @ b (GPT-2's Conv1D): a matmul and an elementwise add."""
    bias, a, b = _args(node)[:3]
    if _argument(node, "beta") != 1 or _argument(node, "alpha") != 1:
        return None
    return lo.call(torch.add, lo.call(torch.matmul, lo.lifted(a, 2), lo.lifted(b, 2)), lo.lifted(bias, 2))


def _linear(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """A linear of an input of rank 2 or more (a layer no op swapped): by the models' own weights,
    a matmul with them transposed; by shared weights, as it is, the N axis one more batch axis."""
    x, w = _args(node)[0], _args(node)[1]
    bias = _argument(node, "bias")
    if lo.rank(x) < 2:
        return None
    if not lo.stacked(w):
        out = lo.call(F.linear, lo.new(x), lo.value(w))
    else:
        rank = max(lo.rank(x), 2)
        transposed = lo.call(torch.transpose, lo.value(w), 1, 2)
        out = lo.call(torch.matmul, lo.lifted(x, rank), lo.call(with_ones, transposed, rank))
    return out if bias is None else lo.call(torch.add, out, lo.lifted(bias, lo.rank(x)))


def _norm(has_bias: bool) -> Rule:
    """layer_norm (`has_bias`) and rms_norm over a model's last dimensions: on a stacked input as it
    is; the models' own weight and bias applied after, each with 1s after N."""

    def rule(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
        x = _args(node)[0]
        weight = _argument(node, "weight")
        bias = _argument(node, "bias") if has_bias else None
        if not (lo.stacked(weight) or lo.stacked(bias)):
            return lo.with_arguments(node)
        x_in = lo.stacked_value(x)
        if x.meta["val"].dtype in (torch.float16, torch.bfloat16):  # one rounding, as the norm's own kernel makes
            x_in = lo.call(torch.Tensor.float, x_in)
        out = lo.with_arguments(node, input=x_in, weight=None, **({"bias": None} if has_bias else {}))
        rank = lo.rank(x)
        if weight is not None:
            out = lo.call(torch.mul, out, lo.lifted(weight, rank))
        if bias is not None:
            out = lo.call(torch.add, out, lo.lifted(bias, rank))
        # the norm's dtype, not the promotion of bf16 activations by fp32 weights
        return lo.call(torch.Tensor.to, out, node.meta["val"].dtype)

    return rule


def _dropout(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """Off, nothing; on, each element draws its own mask, which is each model drawing its own
    (vmap's randomness='different'; 'same' and 'error' are vmap's to honour)."""
    x = _args(node)[0]
    if _argument(node, "train") is False or _argument(node, "p") == 0:
        return lo.value(x)
    return lo.with_arguments(node) if lo.randomness == "different" else None


def _attention(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """Scaled dot-product attention of queries [batch, heads, length, dim]: N folded into the
    batch, one call (torch's fused kernels take 4-d inputs only); the mask broadcast to each
    model's batch where it is not the same for all of it."""
    q, k, v = _args(node)[:3]
    mask = _argument(node, "attn_mask")
    if {lo.rank(q), lo.rank(k), lo.rank(v)} != {4} or (mask is not None and lo.rank(mask) > 4):
        return None
    if _argument(node, "dropout_p") and lo.randomness != "different":
        return None
    kwargs = {a.name: lo.new(_argument(node, a.name)) for a in node.target._schema.arguments[4:]}  # type: ignore[union-attr]
    qkv = [lo.stacked_value(t) for t in (q, k, v)]
    return lo.call(_folded_attention, *qkv, None if mask is None else lo.lifted(mask, 4), lo.stacked(mask), **kwargs)


def _folded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], mask_stacked: bool, **kwargs: Any
) -> torch.Tensor:
    n, batch = q.shape[:2]
    # keys and values broadcast over the queries' batch (a memory of batch 1): each folded sequence gets its own
    k, v = (t.expand(n, batch, *t.shape[2:]) for t in (k, v))
    if mask is not None and mask_stacked:  # [N, batch or 1, heads or 1, L, S]: one per sequence
        mask = mask.expand(n, batch, *mask.shape[2:]).reshape(n * batch, *mask.shape[2:])
    elif mask is not None and mask.dim() == 4 and mask.size(0) != 1:  # the batch's own, the same for every model
        mask = mask.expand(n, *mask.shape).reshape(n * batch, *mask.shape[1:])
    q, k, v = (t.reshape(n * batch, *t.shape[2:]) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, mask, **kwargs)
    return out.reshape(n, batch, *out.shape[1:])


def _item(lo: _Lowering, node: fx.Node) -> Optional[fx.Node]:
    """One tensor of a stacked list (a split's parts)."""
    parts = _args(node)[0]
    if not (lo.stacked(parts) and isinstance(_ranks(parts.meta.get("val")), tuple)):
        return None
    return lo.call(operator.getitem, lo.value(parts), _args(node)[1])


def _rule(target: Any) -> Optional[Rule]:
    """The rule for `target`: its own, or, for an op `pointwise`, the elementwise one."""
    rule = RULES.get(target)
    if rule is not None or not isinstance(target, torch._ops.OpOverload):
        return rule
    return _elementwise if pointwise(target) else None


def pointwise(op: torch._ops.OpOverload) -> bool:
    """Whether `op` acts on each element on its own: torch tags it pointwise, and it writes
    nothing in place and draws nothing. What both captures run at once on stacked values
    (rules.is_elementwise reads it for torch.fx's calls)."""
    tags = op.tags
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and not op._schema.is_mutable


RULES: Dict[Any, Rule] = {
    aten.to.dtype: _elementwise, aten.to.dtype_layout: _elementwise, aten._to_copy.default: _elementwise,
    aten.type_as.default: _type_as,
    aten.contiguous.default: _as_is, aten.clone.default: _as_is, aten.alias.default: _as_is,
    aten.detach.default: _as_is, aten.zeros_like.default: _as_is, aten.ones_like.default: _as_is,
    aten.full_like.default: _as_is, aten.triu.default: _as_is, aten.tril.default: _as_is,
    aten.constant_pad_nd.default: _as_is,
    aten.view.default: _view, aten.reshape.default: _view, aten._unsafe_view.default: _view,
    aten.expand.default: _expand, aten.t.default: _transposed,
    aten.transpose.int: _dims("dim0", "dim1"), aten.permute.default: _permute,
    aten.unsqueeze.default: _dims("dim", extra=1), aten.squeeze.dim: _dims("dim"), aten.squeeze.dims: _dims("dim"),
    aten.select.int: _dims("dim"), aten.slice.Tensor: _dims("dim"), aten.narrow.default: _dims("dim"),
    aten.flip.default: _dims("dims"), aten.roll.default: _dims("dims"),
    aten.flatten.using_ints: _dims("start_dim", "end_dim"), aten.unflatten.int: _dims("dim"),
    aten.chunk.default: _dims("dim"), aten.split.Tensor: _dims("dim"), aten.split_with_sizes.default: _dims("dim"),
    aten.softmax.int: _dims("dim"), aten._softmax.default: _dims("dim"), aten.log_softmax.int: _dims("dim"),
    aten._log_softmax.default: _dims("dim"), aten.cumsum.default: _dims("dim"),
    aten.sum.dim_IntList: _dims("dim"), aten.mean.dim: _dims("dim"), aten.amax.default: _dims("dim"),
    aten.amin.default: _dims("dim"), aten.var.correction: _dims("dim"), aten.std.correction: _dims("dim"),
    aten.cat.default: _joined(0), aten.stack.default: _joined(1),
    aten.matmul.default: _matmul, aten.mm.default: _matmul, aten.bmm.default: _matmul,
    aten.addmm.default: _addmm, aten.linear.default: _linear,
    aten.layer_norm.default: _norm(True), aten.rms_norm.default: _norm(False),
    aten.dropout.default: _dropout,
    aten.scaled_dot_product_attention.default: _attention,
    operator.getitem: _item,
}  # fmt: skip
