"""One model's input and output as a tree of tensors: a tensor, or tuples, lists and dicts of them,
or objects that hold them.

Most ops take one tensor and return one. Users' modules take several (a tuple of
positional arguments), take integer token ids, and return tuples (nn.GRU's output
and hidden state), dicts, or objects holding tensors: a transformers language model returns a
ModelOutput (a pytree node torch knows) holding a DynamicCache (one it does not: its tensors
sit in its attributes, and the cache's layers' in theirs). The runner handles all of them
through these helpers, built on torch's own pytree utilities: `flat` opens what torch's pytree
leaves closed when it holds tensors in its attributes, so two outputs compare tensor by tensor
(GPT-2's were compared as two DynamicCache objects, never equal, and every fused strategy was
called incorrect), vmap can return them, and N models' outputs split one by one.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["call", "call_each", "cast", "clone", "tensors", "flat", "unflat", "map_leaves"]


def call(model: Callable[..., Any], x: Any) -> Any:
    """`model(x)`; a tuple is several positional inputs, `model(*x)`, and a dict keyword inputs, `model(**x)`."""
    if isinstance(x, tuple):
        return model(*x)
    return model(**x) if isinstance(x, dict) else model(x)


def call_each(models: Iterable[Callable[..., Any]], inputs: Iterable[Any]) -> List[Any]:
    """The N separate calls: model i on input i, one by one (the loop every strategy is measured against)."""
    return [call(m, x) for m, x in zip(models, inputs)]


def cast(tree: Any, device: str, dtype: torch.dtype) -> Any:
    """Every tensor moved to `device`; floating-point ones also to `dtype`, integer ones (token ids) kept exact."""
    return map_leaves(
        lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        if isinstance(t, torch.Tensor)
        else t,
        tree,
    )


def clone(tree: Any) -> Any:
    return map_leaves(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def tensors(tree: Any) -> List[torch.Tensor]:
    """Every tensor in the tree, those objects in it hold included."""
    return [t for t in flat(tree)[0] if isinstance(t, torch.Tensor)]


def flat(tree: Any) -> Tuple[List[Any], Any]:
    """(leaves, structure): the tree's leaves, with every object that holds tensors in its
    attributes opened into them; two outputs compare leaf by leaf when their structures are
    equal, and `unflat` builds the tree again from (other) leaves."""
    if isinstance(tree, torch.Tensor):  # most models' input and output: torch's pytree took 10 us for it
        return [tree], _TENSOR
    return _flat(tree, set())


def _flat(tree: Any, opening: Set[int]) -> Tuple[List[Any], Any]:
    leaves, spec = tree_flatten(tree)
    out: List[Any] = []
    opened: List[Optional[Tuple[type, int, Any]]] = []
    for leaf in leaves:
        if _holds_tensors(leaf, opening):
            opening.add(id(leaf))
            inner, inner_spec = _flat(dict(vars(leaf)), opening)
            opening.discard(id(leaf))
            out += inner
            opened.append((type(leaf), len(inner), inner_spec))
        else:
            out.append(leaf)
            opened.append(None)
    return out, (spec, tuple(opened))


def _holds_tensors(x: Any, opening: Set[int]) -> bool:
    """An object torch's pytree leaves whole that holds a tensor somewhere in its attributes (not a
    module, a class or a function; not one being opened: a cycle stays closed)."""
    if isinstance(x, (torch.Tensor, nn.Module, type)) or callable(x) or id(x) in opening:
        return False
    attributes = getattr(x, "__dict__", None)
    if not isinstance(attributes, dict) or not attributes:
        return False
    opening.add(id(x))
    try:
        return any(isinstance(leaf, torch.Tensor) for leaf in _flat(dict(attributes), opening)[0])
    finally:
        opening.discard(id(x))


# The structure `_flat` gives a bare tensor; `flat` returns it without walking (a first call of
# 10,000 Linears spent 0.5 s of its 0.5 s bound flattening their inputs and outputs).
_TENSOR = (tree_flatten(torch.empty(0))[1], (None,))


def unflat(leaves: Sequence[Any], structure: Any) -> Any:
    """The tree `flat` gave `structure` of, with `leaves` in place of its leaves; an opened object
    is rebuilt as an object of its class holding the new values as its attributes."""
    spec, opened = structure
    stream = iter(leaves)
    rebuilt = []
    for how in opened:
        if how is None:
            rebuilt.append(next(stream))
            continue
        cls, count, inner = how
        obj = cls.__new__(cls)
        obj.__dict__.update(unflat([next(stream) for _ in range(count)], inner))
        rebuilt.append(obj)
    return tree_unflatten(rebuilt, spec)


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """The tree with `fn` applied to each of `flat`'s leaves."""
    leaves, structure = flat(tree)
    return unflat([fn(x) for x in leaves], structure)
