"""One model's input and output as a tree of tensors: a tensor, or tuples, lists and dicts of them.

Most ops take one tensor and return one. Users' modules take several (a tuple of
positional arguments), take integer token ids, and return tuples (nn.GRU's output
and hidden state) or dicts; the runner handles all of them through these helpers,
built on torch's own pytree utilities.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

__all__ = ["call", "call_each", "cast", "clone", "tensors", "flat"]


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
    return tree_map(
        lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        if isinstance(t, torch.Tensor)
        else t,
        tree,
    )


def clone(tree: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def tensors(tree: Any) -> List[torch.Tensor]:
    """Every tensor in the tree."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def flat(tree: Any) -> Tuple[List[Any], Any]:
    """(leaves, structure): two outputs compare leaf by leaf when their structures are equal."""
    return tree_flatten(tree)
