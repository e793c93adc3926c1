"""Any nn.Module made wide with torch.func: stacked parameters, vmap over functional_call."""

from __future__ import annotations

import copy
import inspect
import random
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import register_dataclass, tree_flatten, tree_map, tree_unflatten

from ..core import trees
from ..core.errors import NotApplicable, WideTesseraError, unknown, vmap_limitation
from ..core.layout import SHARED, STACKED, Slot, held_once
from ..ops.base import WideOp, shared_config

__all__ = [
    "Packed",
    "unpacked",
    "StackedIO",
    "WideFunctional",
    "RANDOMNESS",
    "vmap_dims",
    "tensors_only",
    "with_others",
    "under_vmap",
    "python_draws_refused",
    "HostGenerators",
    "pads_embeddings",
    "EMBEDDINGS",
    "is_shared",
    "model_size",
    "tied_aliases",
]

# vmap's randomness modes: 'error' refuses random ops; 'different' gives each model its own
# draws (N dropout masks, as N separate calls have); 'same' draws once for all N models.
RANDOMNESS = ("error", "different", "same")


@dataclass
class Packed:
    """The wide input of a model of several or keyword inputs: one value, so that `wide(wide.pack(xs))`
    calls it as `wide(*args, **kwargs)`, whatever the model's signature (a tree of tensors for torch)."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


register_dataclass(Packed)


def unpacked(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """A wide forward's arguments, with one Packed opened."""
    if len(args) == 1 and not kwargs and isinstance(args[0], Packed):
        return args[0].args, args[0].kwargs
    return args, kwargs


class StackedIO(WideOp):
    """The wide layout of whole models. One model's input is a tensor, a tuple of positional
    arguments or a dict of keyword arguments, nested as the model takes them (None where an
    optional argument is left out); the wide input has the same structure, each tensor stacked
    on a new leading axis N. A tensor that is the same object for every model (a mask, RoPE
    tables) is passed once: `expand`ed to N, a view of the one tensor, and what takes the wide
    input may run it once for all (see `vmap_dims`). Each tensor of the output (a tensor, or a
    tuple, list, dict or ModelOutput of them) has N leading. `pack` gives a model of one tensor
    input its stacked tensor, and any other a Packed: the wide module takes either as one value."""

    n: int

    def pack(self, inputs: Sequence[Any]) -> Any:
        """N inputs -> the wide input."""
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise WideTesseraError(f"pack needs a list of the N models' inputs, got {type(inputs).__name__}")
        flat = [tree_flatten(x) for x in inputs]
        for i, (_, spec) in enumerate(flat):
            if spec != flat[0][1]:
                raise WideTesseraError(
                    f"pack: model {i}'s input is shaped {spec}, model 0's {flat[0][1]}; all must have the same"
                )
        leaves = [self._stack([f[0][j] for f in flat], j) for j in range(len(flat[0][0]))]
        wide = tree_unflatten(leaves, flat[0][1])
        if isinstance(wide, tuple):
            return Packed(wide, {})
        return Packed((), wide) if isinstance(wide, dict) else wide

    def _stack(self, values: List[Any], j: int) -> Any:
        """One argument of every model: stacked tensors, one shared tensor expanded, or a value all share."""
        first = values[0]
        if isinstance(first, torch.Tensor) and len(values) > 1 and all(v is first for v in values):
            return first.expand(len(values), *first.shape)
        if isinstance(first, torch.Tensor):
            return super(StackedIO, self).pack(values)
        if any(isinstance(v, torch.Tensor) or v != first for v in values):
            raise WideTesseraError(f"pack: argument {j} differs between the models and is not a tensor: {values!r}")
        return first

    def unpack(self, output: Any) -> List[Any]:
        leaves, structure = trees.flat(output)  # an object holding tensors (a DynamicCache) is rebuilt per model
        parts = [STACKED.parts(t, self.n) if isinstance(t, torch.Tensor) else [t] * self.n for t in leaves]
        return [trees.unflat(list(model), structure) for model in zip(*parts)]


def vmap_dims(tree: Any) -> Tuple[Any, Any]:
    """(the wide values, vmap's in_dims for them): a stacked tensor is mapped over its N axis; a
    shared one (expanded, stride 0 on N) goes in once, unmapped; what is not a tensor is passed as it is."""

    def value(x: Any) -> Any:
        return x[0] if is_shared(x) else x

    def dim(x: Any) -> Optional[int]:
        return 0 if isinstance(x, torch.Tensor) and not is_shared(x) else None

    return tree_map(value, tree), tree_map(dim, tree)


@contextmanager
def under_vmap(randomness: str, pads: bool = False) -> Iterator[Optional["_PaddingWithoutGradient"]]:
    """What every vmap over the models' own code runs inside:

    * torch's vmap refusing what it was given said in one line (core.errors.vmap_limitation);
    * a vmap refusing a draw under randomness='error' said in one line, with what to give instead:
      fuse() or WideSurgery of models with dropout in training raised torch's 80-line traceback
      (benchmark_custom says it before measuring);
    * where the code may look embeddings up with a padding_idx (`pads`), in training, lookups that
      give the padding row no gradient in every model (_PaddingWithoutGradient, yielded: whether it
      `saw` one). Not elsewhere: a mode sees every torch call, and cost a BertLayer's training step
      under vmap about 10% (N=8, one thread)."""
    mode = _PaddingWithoutGradient() if pads and torch.is_grad_enabled() else None
    try:
        with mode if mode is not None else nullcontext():
            yield mode
    except RuntimeError as e:
        limitation = vmap_limitation(e)
        if limitation is not None:  # nonzero, .item(), a bidirectional GRU: torch's 30-line traceback
            raise NotApplicable(limitation) from None
        if randomness != "error" or "called random operation while in randomness error mode" not in str(e):
            raise
        raise WideTesseraError(
            "the models draw random numbers (dropout in train mode?): give randomness='different' (each model its "
            "own draws) or 'same' (one draw for all)"
        ) from None


class _PaddingWithoutGradient(TorchFunctionMode):
    """Embedding lookups with a padding_idx, their padding tokens' rows taken without gradient.

    torch's vmap of an embedding looks the N models' indices up in their tables flattened into
    one, and its padding_idx stays one row of that: in training, every model but the first gave
    its padding row a gradient (a tiny LlamaForCausalLM with pad_token_id=0,
    fused by vmap, clipped by per-model norms of [1.56, 11.70, 3.49, 1.93] where torch's were
    [1.56, 2.28, 1.56, 1.67]). Looked up without padding_idx, with the padding tokens' outputs
    detached, each model's gradient is torch's: no lookup of a padding token reaches its row,
    and a row tied to another layer (an LM head) still gets that layer's gradient."""

    saw = False  # a lookup with a padding_idx

    def __torch_function__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        self.saw = self.saw or func in EMBEDDINGS
        if func is F.embedding and torch.is_grad_enabled():
            bound = _EMBEDDING.bind(*args, **kwargs).arguments
            padding = bound.pop("padding_idx", None)
            if padding is not None:
                out = func(**bound)
                return _detached_at(out, bound["input"], padding % bound["weight"].shape[0])
        if func in EMBEDDINGS[1:] and torch.is_grad_enabled():
            weight, indices = args[:2]
            padding = args[2] if len(args) > 2 else kwargs.pop("padding_idx", -1)
            if padding >= 0:  # aten's -1: none
                return _detached_at(func(weight, indices, -1, *args[3:], **kwargs), indices, padding)
        return func(*args, **kwargs)


_EMBEDDING = inspect.signature(F.embedding)
EMBEDDINGS = (F.embedding, torch.embedding, torch.ops.aten.embedding.default)


def pads_embeddings(module: nn.Module) -> bool:
    """Whether `module` holds an embedding with a padding_idx (nn.Embedding, its subclasses, nn.EmbeddingBag)."""
    return any(getattr(m, "padding_idx", None) is not None for m in module.modules())


def _detached_at(out: torch.Tensor, indices: torch.Tensor, padding: int) -> torch.Tensor:
    return torch.where((indices == padding).unsqueeze(-1), out.detach(), out)


class HostGenerators:
    """Python's and NumPy's global generators as they are when this is made: whether they have
    `moved` since, and `restore` them. torch's own are forked where they are kept (fork_rng)."""

    def __init__(self) -> None:
        self.python, self.numpy = random.getstate(), np.random.get_state(legacy=False)

    def moved(self) -> bool:
        now, then = np.random.get_state(legacy=False)["state"], self.numpy["state"]
        numpy_moved = now["pos"] != then["pos"] or not np.array_equal(now["key"], then["key"])
        return numpy_moved or random.getstate() != self.python

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)


@contextmanager
def python_draws_refused(what: str, looking: bool = True) -> Iterator[None]:
    """Refuse, in one line, models whose forward draws from Python's or NumPy's global generator:
    a captured graph keeps the draw its capture made for every later call, and vmap draws once
    for all N models, where N separate calls draw N times (a stochastic depth written with
    random.random() ran the capture's choice at every step, silently)."""
    before = HostGenerators() if looking else None
    yield
    if before is not None and before.moved():
        raise NotApplicable(
            f"{what}: the models draw from Python's or NumPy's random generator in forward, which a fused model "
            "cannot draw for each model; draw with torch (torch.rand, dropout) and randomness='different'"
        )


def is_shared(x: Any) -> bool:
    """A tensor passed once for all N models: expanded, stride 0 on its N axis."""
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.stride(0) == 0 and x.size(0) > 1


def with_ones(stacked: torch.Tensor, rank: int) -> torch.Tensor:
    """A stacked tensor of a model's rank below `rank` with 1s after its N axis: broadcast
    against the others, each model's trailing dimensions align as they do for one model."""
    return stacked.reshape(stacked.shape[0], *[1] * (rank + 1 - stacked.dim()), *stacked.shape[1:])


def model_size(x: torch.Tensor, dim: int) -> int:
    """One model's size `dim` of a value stacked on a leading N axis: the stack's, one axis on."""
    return x.size(dim + 1 if dim >= 0 else dim)


def tensors_only(fn: Callable[..., Any], kept: List[Any]) -> Callable[..., Tuple[torch.Tensor, ...]]:
    """`fn` returning only its output's tensors, as vmap needs; `kept` gets (structure, other leaves)."""

    def call(*args: Any, **kwargs: Any) -> Tuple[torch.Tensor, ...]:
        leaves, structure = trees.flat(fn(*args, **kwargs))  # a DynamicCache's tensors too: none escapes vmap
        kept[:] = [structure, [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]]
        return tuple(t for t in leaves if isinstance(t, torch.Tensor))

    return call


def with_others(tensors: Sequence[torch.Tensor], kept: List[Any]) -> Any:
    """The output tensors_only split, whole again."""
    structure, others = kept
    stream = iter(tensors)
    return trees.unflat([next(stream) if o is _TENSOR else o for o in others], structure)


def tied_aliases(module: nn.Module) -> Dict[str, str]:
    """Each second name of a tied parameter or buffer -> its first name (the one stack_module_state keeps)."""
    first: Dict[int, str] = {}
    aliases = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return aliases


def _stacked(values: List[nn.Parameter]) -> nn.Parameter:
    return nn.Parameter(STACKED.join([p.detach() for p in values]), requires_grad=values[0].requires_grad)


_TENSOR = object()  # where tensors_only took a tensor out (an output may hold None itself)


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
        params = {name: [m.get_parameter(name) for m in modules] for name, _ in modules[0].named_parameters()}
        buffers = {name: STACKED.join([m.get_buffer(name) for m in modules]) for name, _ in modules[0].named_buffers()}
        self._param_names, self._buffer_names = list(params), list(buffers)
        # a frozen tensor every model holds (a LoRA base): the models' own, held once and read
        # once by the N models' calls (vmap's in_dims None), not stacked into N copies
        self._once = {name for name, values in params.items() if held_once(values)}
        # a weight tied to another (GPT-2's lm_head to its embedding) under its second name: the
        # skeleton on the meta device no longer ties them, and functional_call left lm_head's
        # weight a meta tensor (logits off by 1e24)
        self._aliases = tied_aliases(modules[0])
        self.stacked_params = nn.ParameterList(
            [values[0] if name in self._once else _stacked(values) for name, values in params.items()]
        )
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
