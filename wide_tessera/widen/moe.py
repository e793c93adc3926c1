"""N sparse mixture-of-experts blocks as one block of N·E experts.

A sparse MoE block routes each token to its top-k of E experts. It is recognised by its
structure, whatever its attributes are called: it holds no parameter of its own, one child is a
router (its only matrix an [E, d] weight: a score per expert) and another holds the E experts
stacked (every parameter at least a matrix, all sharing a first dimension that is a multiple of
E: [E, ...] as Mixtral's, or [E·f, d] as DBRX's). vmap cannot run such a block (its experts loop
over the experts a batch hit: a data-dependent shape) and torch.fx cannot trace it.

N of them are one block instead, running the block's own code once on the N models' tokens, one
model after another on the first axis: its router is the N routers, each on its own model's
tokens (under vmap), whose choices are offset to that model's experts; its experts are the N
models' side by side (N·E experts, one call of the block's own experts implementation); any
other child (Qwen2-MoE's shared expert and its gate) runs per model under vmap. A router that
gives scores alone (DBRX's, whose block takes the top-k itself) has each model's scores placed
among the N·E with -inf elsewhere: a softmax or top-k taken after stays within its own experts.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..core.errors import NotApplicable
from ..core.layout import JOINED, Slot, prefixed, slots_of
from .functional import WideFunctional
from .packing import StackedIO, unpacked

__all__ = ["WideSparseMoe", "is_sparse_moe", "loops_over_experts", "exportable_copy"]


def moe_parts(module: nn.Module) -> Optional[Tuple[str, str, int]]:
    """(the router's name, the experts' name, E) of a sparse MoE block (see the module's
    docstring); None for any other module."""
    if next(module.parameters(recurse=False), None) is not None:
        return None
    children = dict(module.named_children())
    for router, r in children.items():
        scores = _scores(r)
        for experts, x in children.items():
            if scores is not None and experts != router and _stacks_experts(x, *scores):
                return router, experts, scores[0]
    return None


def _scores(module: nn.Module) -> Optional[Tuple[int, int]]:
    """(E, d) where the module's only matrix is an [E, d] weight, E >= 2, and any other parameter an [E] bias."""
    params = list(module.parameters())
    matrices = [p for p in params if p.dim() == 2]
    if len(matrices) != 1 or any(p.dim() != 2 and p.shape != matrices[0].shape[:1] for p in params):
        return None
    e, d = matrices[0].shape
    return (e, d) if e >= 2 else None


def _stacks_experts(module: nn.Module, e: int, d: int) -> bool:
    """Whether the module's parameters are E experts' of width d stacked: each [E, ...] with d in
    its shape, or, flattened, two or more of one shape [E·f, d]. (A Linear's [E·f, d] alone, or an
    attention's projections beside a Linear [E, d], are no experts: each was taken for them.)"""
    params = list(module.parameters())
    if params and all(p.dim() >= 3 and p.shape[0] == e and d in p.shape[1:] for p in params):
        return True
    shapes = {p.shape for p in params}
    return len(params) >= 2 and len(shapes) == 1 and len(s := shapes.pop()) == 2 and s[0] % e == 0 and s[1] == d


def is_sparse_moe(module: nn.Module) -> bool:
    """A sparse MoE block: a router of E experts and the E experts stacked (see the module's docstring)."""
    return moe_parts(module) is not None


def loops_over_experts(module: nn.Module) -> bool:
    """A sparse MoE block whose experts loop over the experts a batch hit (`aten::nonzero`: a shape
    vmap cannot batch): those of transformers' eager experts implementation, and those that have
    no other (DBRX's)."""
    parts = moe_parts(module)
    config = parts and getattr(module.get_submodule(parts[1]), "config", None)
    return parts is not None and getattr(config, "_experts_implementation", None) in (None, "eager")


class WideSparseMoe(StackedIO, nn.Module):
    """N sparse MoE blocks of one configuration as one block of N·E experts (see the module's
    docstring). Wide layout: StackedIO's, hidden states [N, batch, seq, d]."""

    def __init__(self, modules: Sequence[nn.Module], randomness: str = "error"):
        super().__init__()
        parts = moe_parts(modules[0])
        if parts is None:
            raise NotApplicable(f"{type(modules[0]).__name__} is not a sparse MoE block of stacked experts")
        self.router, self.experts, e = parts
        self.n = n = len(modules)
        self.block = copy.deepcopy(modules[0])
        for name, _ in modules[0].named_children():
            subs = [m.get_submodule(name) for m in modules]
            if name == self.experts:
                wide: nn.Module = _joined_experts(subs)
            else:
                wide = _OwnTokens(subs, randomness, e if name == self.router else None)
            setattr(self.block, name, wide)
        # the block's and its experts' counts of experts (one_hot(num_classes=num_experts + 1) in the
        # experts' loop: with E left, the offset choices of model 1 on were out of its range)
        for m in [self.block, *self.block.get_submodule(self.experts).modules()]:
            for k, v in vars(m).items():
                if "expert" in k and type(v) is int and v == e:
                    setattr(m, k, n * e)
        self.train(modules[0].training)

    def model_slots(self) -> Dict[str, Slot]:
        """The per-model children's slots, and the experts side by side on their first axis."""
        slots: Dict[str, Slot] = {}
        for name, child in self.block.named_children():
            if name == self.experts:
                slots.update({f"block.{name}.{k}": Slot(f"{name}.{k}", JOINED) for k in child.state_dict()})
            else:
                slots.update(prefixed(slots_of(child.get_submodule("wide")), f"block.{name}.wide", name))
        return slots

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = unpacked(args, kwargs)
        out = self.block(*_merged(args), **_merged(kwargs))
        return _stacked(out, self.n)


def _joined_experts(experts: Sequence[nn.Module]) -> nn.Module:
    """The N models' experts as one module of N·E: each parameter the N models' joined on its first axis."""
    wide = copy.deepcopy(experts[0])
    with torch.no_grad():
        for name, p in experts[0].named_parameters():
            owner, _, leaf = name.rpartition(".")
            joined = JOINED.join([m.get_parameter(name).detach() for m in experts])
            setattr(wide.get_submodule(owner), leaf, nn.Parameter(joined, requires_grad=p.requires_grad))
    return wide


class _OwnTokens(nn.Module):
    """A child of the N blocks, each model's on its own tokens: the block's input to it holds the N
    models' tokens one model after another on its first axis, and so does what it returns. A
    router (`e`: its experts) gives choices among the N·E experts: each model's offset to its own,
    or, where it gives scores alone, each model's scores among the N·E with -inf elsewhere."""

    def __init__(self, modules: Sequence[nn.Module], randomness: str, e: Optional[int]):
        super().__init__()
        self.wide, self.n, self.e = WideFunctional(modules, randomness), len(modules), e

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _stacked((args, kwargs), self.n)
        out = self.wide(*args, **kwargs)
        e = self.e
        if e is not None:
            chooses = any(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in tree_flatten(out)[0])
            out = tree_map(lambda t: _among_all(t, self.n, e, chooses) if isinstance(t, torch.Tensor) else t, out)
        return _merged(out)


def _among_all(t: torch.Tensor, n: int, e: int, chooses: bool) -> torch.Tensor:
    """A router's output for each model's E experts (stacked on N) -> for the N·E."""
    if not t.is_floating_point():  # model i's choices of its E experts: experts i·E.. of the N·E
        return t + e * torch.arange(n, device=t.device).view(n, *[1] * (t.dim() - 1))
    if chooses or t.shape[-1] != e:  # the weights of the choices, or the scores the choices came from
        return t
    own = torch.eye(n, dtype=torch.bool, device=t.device).view(n, *[1] * (t.dim() - 2), n, 1)
    return torch.where(own, t.unsqueeze(-2), float("-inf")).flatten(-2)


def _stacked(tree: Any, n: int) -> Any:
    """Each tensor holding the N models' values one after another on its first axis -> stacked on a new one."""
    return tree_map(lambda t: t.reshape(n, -1, *t.shape[1:]) if isinstance(t, torch.Tensor) else t, tree)


def _merged(tree: Any) -> Any:
    """Each tensor stacked on N -> the N models' values one after another on its first axis."""
    return tree_map(lambda t: t.flatten(0, 1) if isinstance(t, torch.Tensor) and t.dim() > 1 else t, tree)


def exportable_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` for torch.export to run, each sparse MoE block replaced by a stand-in
    (the wide block is swapped in whole)."""
    skeleton = copy.deepcopy(model)
    for path, sub in list(skeleton.named_modules()):
        if path and is_sparse_moe(sub):
            if getattr(getattr(model, "config", None), "output_router_logits", False):
                # the model records its routers' logits (for the load-balancing loss) by hooks
                # on blocks a stand-in replaces: torch.export's "tuple index out of range"
                raise NotApplicable(
                    f"surgery swaps sparse MoE block {path} whole, and {type(model).__name__} records its "
                    "router's logits (output_router_logits=True), which the wide block does not give"
                )
            skeleton.set_submodule(path, _MoeStandIn())
    return skeleton


class _MoeStandIn(nn.Module):
    """What torch.export captures of a sparse MoE block: a copy of its input, which its output is
    shaped as. The block's own experts loop over the experts a batch hit (a data-dependent shape
    torch.export refuses: DbrxBlock's capture failed on it), and its call is WideSparseMoe's anyway."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)).clone()
