"""Any nn.Module made wide with torch.func: stacked parameters, vmap over functional_call."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.func import functional_call, vmap

from ..core.errors import NotApplicable, unknown
from ..core.layout import SHARED, STACKED, Slot, held, tied_aliases
from ..ops.alike import shared_config
from .host_draws import python_draws_refused
from .packing import StackedIO, unpacked
from .vmapping import pads_embeddings, tensors_only, under_vmap, vmap_dims, with_others

__all__ = ["WideFunctional", "RANDOMNESS"]

# vmap's randomness modes: 'error' refuses random ops; 'different' gives each model its own
# draws (N dropout masks, as N separate calls have); 'same' draws once for all N models.
RANDOMNESS = ("error", "different", "same")


class WideFunctional(StackedIO, nn.Module):
    """N copies of one module class, run as one vmapped call; the layout is StackedIO's.
    `randomness` is vmap's (see RANDOMNESS)."""

    NAME = "WideFunctional"  # not a registered op: fuse() and benchmark_custom name a custom class by its own name
    BENCHMARK_STRATEGIES = ("vmap",)

    def __init__(self, modules: Sequence[nn.Module], randomness: str = "error"):
        super().__init__()
        if randomness not in RANDOMNESS:
            raise unknown("randomness", randomness, RANDOMNESS)
        self.n, self.randomness = len(modules), randomness
        # whether its code looks embeddings up with a padding_idx: it holds such an embedding, or,
        # where it does not (F.embedding in its own code: models 1 and 2 gave their padding rows
        # gradients of 10.7 and 16.6), what its first call in training saw
        self.pads: Optional[bool] = True if pads_embeddings(modules[0]) else None
        self._looked: Set[bool] = set()  # the modes (training or not) of calls looked at for buffers assigned
        # its backward raised torch's "reshape is not implemented for sparse tensors"
        self.sparse = next((p for p, m in modules[0].named_modules() if getattr(m, "sparse", False) is True), None)
        # a frozen tensor every model holds (a LoRA base): the models' own, held once and read
        # once by the N models' calls (vmap's in_dims None), not stacked into N copies
        params = {name: held([m.get_parameter(name) for m in modules]) for name, _ in modules[0].named_parameters()}
        buffers = {name: held([m.get_buffer(name) for m in modules])[0] for name, _ in modules[0].named_buffers()}
        self._param_names, self._buffer_names = list(params), list(buffers)
        self._once = {name for name, (_, layout) in params.items() if layout.shared}
        # a weight tied to another (GPT-2's lm_head to its embedding) under its second name: the
        # skeleton on the meta device no longer ties them, and functional_call left lm_head's
        # weight a meta tensor (logits off by 1e24)
        self._aliases = tied_aliases(modules[0])
        self.stacked_params = nn.ParameterList([tensor for tensor, _ in params.values()])
        kept = modules[0].state_dict()  # a buffer the model does not save (rotary tables) is not saved here either
        for i, (name, b) in enumerate(buffers.items()):
            self.register_buffer(f"stacked_buffer_{i}", b, persistent=name in kept)
        # A structure-only copy for functional_call; kept out of the module tree so .to() and
        # state_dict see only the stacked tensors. It keeps the modules' train/eval mode.
        self._skeleton: Tuple[nn.Module] = (copy.deepcopy(modules[0]).to("meta"),)
        self.train(modules[0].training)

    @classmethod
    def from_modules(
        cls, modules: Sequence[nn.Module], strategy: Optional[str] = None, randomness: str = "error"
    ) -> "WideFunctional":
        cls.check_strategy(strategy)
        shared_config(modules, nn.Module, lambda m: dict(cls=type(m).__name__))  # layouts included
        return cls(modules, randomness)

    def model_slots(self) -> Dict[str, Slot]:
        """Each stacked tensor, by the name it has in one model."""
        params = {
            f"stacked_params.{i}": Slot(name, SHARED if name in self._once else STACKED)
            for i, name in enumerate(self._param_names)
        }
        buffers = {f"stacked_buffer_{i}": Slot(name, STACKED) for i, name in enumerate(self._buffer_names)}
        kept = self.state_dict(keep_vars=True)
        return {k: slot for k, slot in {**params, **buffers}.items() if k in kept}

    def _state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        params = dict(zip(self._param_names, self.stacked_params))
        buffers = {name: getattr(self, f"stacked_buffer_{i}") for i, name in enumerate(self._buffer_names)}
        for alias, name in self._aliases.items():
            (params if name in params else buffers)[alias] = params.get(name, buffers.get(name))
        return params, buffers

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.sparse is not None and torch.is_grad_enabled():
            raise NotApplicable(
                f"vmap cannot give {self.sparse or 'the model'}'s sparse gradients: call it under torch.no_grad() to "
                "infer, or train a dense embedding"
            )
        args, kwargs = unpacked(args, kwargs)
        skeleton = self._skeleton[0].train(self.training)

        assigned: List[str] = []
        # A forward that assigns a buffer (self.c = self.c + x) assigns it on the skeleton, and
        # functional_call puts the given one back: the update was lost, silently (outputs 1.1 off
        # from the second call). Looked for, while forward's tensors are in
        # place, on the first call in train and in eval: a hook on every call cost 24 us of 325.
        # Draws from Python's or NumPy's generator, too (python_draws_refused).
        first = self.training not in self._looked
        look = bool(self._buffer_names) and first

        def one(
            params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor], a: Tuple[Any, ...], k: Dict[str, Any]
        ) -> Any:
            def seen(module: nn.Module, inputs: Any, output: Any) -> None:
                assigned.extend(name for name, b in buffers.items() if module.get_buffer(name) is not b)

            with skeleton.register_forward_hook(seen) if look else nullcontext():
                return functional_call(skeleton, (params, buffers), a, k)

        (args, kwargs), dims = vmap_dims((args, kwargs))
        params, buffers = self._state()
        held = {name: None if self._aliases.get(name, name) in self._once else 0 for name in params}
        kept: List[Any] = []
        with under_vmap(self.randomness, self.pads is not False) as mode, python_draws_refused("vmap", first):
            out = vmap(tensors_only(one, kept), in_dims=(held, 0, *dims), randomness=self.randomness)(
                params, buffers, args, kwargs
            )
        if assigned:
            raise NotApplicable(
                f"vmap cannot keep forward's assignment to buffer {', '.join(dict.fromkeys(assigned))}: update it in "
                "place (.copy_, .add_), or fuse by surgery"
            )
        if first:
            self._looked.add(self.training)
        if mode is not None and self.pads is None:
            self.pads = mode.saw
        return with_others(out, kept)
