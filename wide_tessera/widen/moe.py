"""N sparse mixture-of-experts blocks as one block of N·E experts.

A transformers MoE block (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, ...) routes each token
to its top-k of E experts, kept as 3-D tensors [E, ...] in one experts module. vmap cannot run
it (the experts loop over the experts a batch hit: a data-dependent shape) and torch.fx cannot
trace it. N of them are one block instead: each model's router runs on its own tokens (under
vmap: a linear, a softmax and a top-k), its choices are offset to its own experts, and one
call of the block's own experts implementation, holding the N models' experts side by side,
runs every model's tokens. A shared expert beside the routed ones (Qwen2-MoE) runs under vmap.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Dict, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import NotApplicable
from ..core.layout import JOINED, Slot, prefixed, slots_of
from .functional import StackedIO, WideFunctional, unpacked

__all__ = ["WideSparseMoe", "is_sparse_moe", "loops_over_experts"]


def is_sparse_moe(module: nn.Module) -> bool:
    """A block with a router `gate` (top_k of num_experts) and `experts` holding them as 3-D tensors."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (
        isinstance(gate, nn.Module)
        and isinstance(getattr(gate, "top_k", None), int)
        and isinstance(experts, nn.Module)
        and isinstance(getattr(experts, "num_experts", None), int)
        and any(p.dim() == 3 and p.shape[0] == experts.num_experts for p in experts.parameters(recurse=False))
    )


def loops_over_experts(module: nn.Module) -> bool:
    """A sparse MoE block on transformers' eager experts implementation, which loops over the
    experts a batch hit (`aten::nonzero`: a shape vmap cannot batch)."""
    config = getattr(getattr(module, "experts", None), "config", None)
    return is_sparse_moe(module) and getattr(config, "_experts_implementation", None) in (None, "eager")


class WideSparseMoe(StackedIO, nn.Module):
    """N sparse MoE blocks of one configuration as one block of N·E experts (see the module's
    docstring). Wide layout: StackedIO's, hidden states [N, batch, seq, d]."""

    def __init__(self, modules: Sequence[nn.Module], randomness: str = "error"):
        super().__init__()
        if not is_sparse_moe(modules[0]):
            raise NotApplicable(f"{type(modules[0]).__name__} is not a sparse MoE block of 3-D experts")
        self.n, self.e = len(modules), modules[0].experts.num_experts
        self.routers = WideFunctional([m.gate for m in modules], randomness)
        self.experts = copy.deepcopy(modules[0].experts)
        self.experts.num_experts = self.n * self.e
        with torch.no_grad():
            for name, p in modules[0].experts.named_parameters(recurse=False):
                joined = JOINED.join([getattr(m.experts, name).detach() for m in modules])
                setattr(self.experts, name, nn.Parameter(joined, requires_grad=p.requires_grad))
        shared = [getattr(m, "shared_expert", None) for m in modules]
        self.shared = None if shared[0] is None else WideFunctional(shared, randomness)
        gates = [getattr(m, "shared_expert_gate", None) for m in modules]
        self.shared_gate = None if gates[0] is None else WideFunctional(gates, randomness)
        self.input_name = next(iter(inspect.signature(modules[0].forward).parameters))
        self.train(modules[0].training)

    def model_slots(self) -> Dict[str, Slot]:
        """The routers' and shared experts' slots, and the experts side by side on their first axis."""
        slots = prefixed({k: Slot(k, JOINED) for k in self.experts.state_dict()}, "experts", "experts")
        slots.update(prefixed(slots_of(self.routers), "routers", "gate"))
        if self.shared is not None:
            slots.update(prefixed(slots_of(self.shared), "shared", "shared_expert"))
        if self.shared_gate is not None:
            slots.update(prefixed(slots_of(self.shared_gate), "shared_gate", "shared_expert_gate"))
        return slots

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        args, kwargs = unpacked(args, kwargs)  # the block takes its hidden states alone, by position or name
        hidden_states = kwargs[self.input_name] if self.input_name in kwargs else args[0]
        n, shape = self.n, hidden_states.shape
        tokens = hidden_states.reshape(n, -1, shape[-1])  # [N, T, d]
        _, weights, chosen = self.routers(tokens)  # [N, T, k]: each model's router on its own tokens
        own = chosen + self.e * torch.arange(n, device=chosen.device).view(n, 1, 1)  # model i's experts
        out = self.experts(tokens.reshape(-1, shape[-1]), own.reshape(-1, own.shape[-1]),
                           weights.reshape(-1, weights.shape[-1])).view_as(tokens)  # fmt: skip
        if self.shared is not None:
            shared = self.shared(tokens)
            out = out + (F.sigmoid(self.shared_gate(tokens)) * shared if self.shared_gate is not None else shared)
        return out.reshape(shape)
