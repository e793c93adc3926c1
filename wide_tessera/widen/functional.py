"""Any nn.Module made wide with torch.func: stacked parameters, vmap over functional_call."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.utils._pytree import tree_map

from ..core.errors import WideTesseraError, unknown
from ..ops.base import WideOp, shared_config

__all__ = ["StackedIO", "WideFunctional", "RANDOMNESS"]

# vmap's randomness modes: 'error' refuses random ops; 'different' gives each model its own
# draws (N dropout masks, as N separate calls have); 'same' draws once for all N models.
RANDOMNESS = ("error", "different", "same")


class StackedIO(WideOp):
    """The wide layout of whole models: each input stacked on a new leading axis N (a module of
    two inputs takes two stacked tensors); each tensor of the output (a tensor, or a tuple,
    list or dict of them) has N leading."""

    n: int

    def pack(self, inputs: Sequence[Any]) -> Any:
        """N inputs -> the wide input: a stacked tensor, or for several inputs a tuple of them."""
        if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, tuple) for x in inputs):
            arity = {len(x) for x in inputs}
            if len(arity) > 1:
                raise WideTesseraError(f"pack: the models' inputs have {sorted(arity)} parts; all must have the same")
            return tuple(super(StackedIO, self).pack([x[j] for x in inputs]) for j in range(len(inputs[0])))
        return super().pack(inputs)

    def unpack(self, output: Any) -> List[Any]:
        return [tree_map(lambda t, i=i: t[i], output) for i in range(self.n)]


class WideFunctional(StackedIO, nn.Module):
    """N copies of one module class, run as one vmapped call; the layout is StackedIO's.
    `randomness` is vmap's (see RANDOMNESS)."""

    NAME = "custom"
    BENCHMARK_STRATEGIES = ("vmap",)

    def __init__(self, modules: Sequence[nn.Module], randomness: str = "error"):
        super().__init__()
        if randomness not in RANDOMNESS:
            raise unknown("randomness", randomness, RANDOMNESS)
        self.n, self.randomness = len(modules), randomness
        params, buffers = stack_module_state(list(modules))
        self._param_names, self._buffer_names = list(params), list(buffers)
        self.stacked_params = nn.ParameterList(
            [nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in params.values()]
        )
        for i, b in enumerate(buffers.values()):
            self.register_buffer(f"stacked_buffer_{i}", b)
        # A structure-only copy for functional_call; kept out of the module tree so .to() and
        # state_dict see only the stacked tensors. It keeps the modules' train/eval mode.
        self._skeleton: Tuple[nn.Module] = (copy.deepcopy(modules[0]).to("meta"),)
        self.train(modules[0].training)

    @classmethod
    def from_modules(
        cls, modules: Sequence[nn.Module], strategy: Optional[str] = None, randomness: str = "error"
    ) -> "WideFunctional":
        cls.check_strategy(strategy)
        shared_config(modules, nn.Module, lambda m: dict(cls=type(m).__name__))
        return cls(modules, randomness)

    def _state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        params = dict(zip(self._param_names, self.stacked_params))
        buffers = {name: getattr(self, f"stacked_buffer_{i}") for i, name in enumerate(self._buffer_names)}
        return params, buffers

    def forward(self, *inputs: torch.Tensor) -> Any:
        skeleton = self._skeleton[0].train(self.training)

        def one(params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor], *xs: torch.Tensor) -> Any:
            return functional_call(skeleton, (params, buffers), xs)

        return vmap(one, randomness=self.randomness)(*self._state(), *inputs)
