"""Which values of a captured graph carry the N axis: one pass that marks each node in
`node.meta[N_AXIS]`, the one fact both rewrites read (surgery.py's of torch.fx's graph,
exported.py's and lowering.py's of torch.export's).

A value carries the N axis (0: each model's own, stacked on a leading axis) where its source
says so: an input, a model's parameter held stacked, a layer holding each model's weights; or,
where its source says nothing, where any value it is computed from carries it: an op cannot
make the models' values one again. A value none of them carries (None: a constant, a size, a
frozen tensor held once, what is computed from those alone) is the same for every model.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from torch import fx

__all__ = ["N_AXIS", "mark", "stacked"]

N_AXIS = "n_axis"


def mark(nodes: Iterable[fx.Node], source: Callable[[fx.Node], Optional[bool]]) -> None:
    """Each of `nodes` (in the graph's order) marked: stacked where `source` says True, shared
    where it says False; where it says None, stacked if any of its inputs is."""
    for node in nodes:
        said = source(node)
        own = any(stacked(a) for a in node.all_input_nodes) if said is None else said
        node.meta[N_AXIS] = 0 if own else None


def stacked(value: Any) -> bool:
    """Whether `value` is a node marked as carrying the N axis (an argument that is no node, a
    number written in the graph, carries none)."""
    return isinstance(value, fx.Node) and value.meta[N_AXIS] is not None
