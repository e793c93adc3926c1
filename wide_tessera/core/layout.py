"""Where the N models' values lie in a wide tensor, and the way back: the one home of stacking
and unstacking N models.

A wide module holds the N models' tensors of one name (a parameter, a buffer, an input) in one
tensor, and its `Layout` says where model i's part is: stacked on a new axis (a WideLinear's
weight, [N, out, in]), joined along an axis the models already have (a grouped convolution's
weight, [N*C_out, C_in, k], or its input's channels), or all of it one model's (a loop's
modules, `Layout.own(i)`). Everything that moves between one model and N derives from it:

* `join`: the N models' tensors -> the wide tensor (from_modules, pack);
* `parts`: the wide tensor -> each model's part (unpack, state_dicts, unfuse);
* `spread`: one value per model (a learning rate) -> a tensor that broadcasts against the wide one
  (per-model optimizers);
* `norms`: each model's norm of a wide tensor (per-model gradient clipping).

A wide module says how it holds the models with `model_slots()`: for each tensor of its
state_dict, the name the tensor has in one model and its Layout (a `Slot`). `slots_of` reads
them, `load_joined` fills a wide module from N models by them, and `model_state_dicts` gives the
N models' state_dicts back.

A frozen tensor all N models hold (`held_once`: a LoRA base, a frozen backbone) is held once,
SHARED: the wide module keeps the models' own tensor, and the N batches fold through it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import chain
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from . import trees
from .errors import ContractError, WideTesseraError

__all__ = [
    "Layout",
    "STACKED",
    "JOINED",
    "SHARED",
    "Slot",
    "slots_of",
    "named_tensors",
    "prefixed",
    "own_slots",
    "loop_slots",
    "load_joined",
    "model_state_dicts",
    "persistent_tensors",
    "held_once",
    "held",
    "models_of",
    "stacked_tree",
    "tied_aliases",
    "second_names",
]


@dataclass(frozen=True)
class Layout:
    """Where each model's part of a wide tensor is.

    dim: the axis holding the N models. joined: False, stacked on a new axis `dim` (model i's
    part is `wide.select(dim, i)`); True, joined along the models' own axis `dim` in N equal
    blocks (`wide.chunk(n, dim)[i]`). model: set, the whole tensor is that one model's (`dim`
    and `joined` unused).
    """

    dim: int = 0
    joined: bool = False
    model: Optional[int] = None
    # the whole tensor is every model's, held once: a frozen base N LoRA adapters share
    shared: bool = False

    @staticmethod
    def own(i: int) -> "Layout":
        """A tensor that is all model i's: one of a loop's modules."""
        return Layout(model=i)

    def join(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The N models' tensors (in model order) as one wide tensor."""
        if self.model is not None:
            raise ContractError("a tensor owned by one model joins nothing")
        if self.shared:  # the models hold it as one (the wide module's from_modules checked they do)
            return values[0]
        return torch.cat(list(values), self.dim) if self.joined else torch.stack(list(values), self.dim)

    def parts(self, wide: torch.Tensor, n: int) -> List[Optional[torch.Tensor]]:
        """Each model's part of `wide`, a view (None for a model with no part in it)."""
        if self.model is not None:
            return [wide if i == self.model else None for i in range(n)]
        if self.shared:
            return [wide] * n
        size = wide.shape[self.dim]
        if (size % n if self.joined else size != n) or size == 0:
            raise WideTesseraError(
                f"a wide value of shape {list(wide.shape)} does not hold {n} models on axis {self.dim}: give what "
                f"the wide module of {n} models gave"
            )
        return list(wide.chunk(n, self.dim) if self.joined else wide.unbind(self.dim))

    def relaid(self, wide: torch.Tensor, n: int, to: "Layout") -> torch.Tensor:
        """`wide`, laid out by this layout, laid out by `to`, where one of the two is stacked on
        axis 0 and the other joins the models' own axis: a view (a copy only where its strides
        allow none), not the N parts joined again. A grouped convolution's input, joined from N
        parts and its output stacked again on every call, copied the activations four times a
        training step (a quarter of the step of 16 small conv nets, one CPU thread)."""
        if self.model is None and not self.shared and to.model is None and not to.shared:
            if not self.joined and self.dim == 0 and to.joined:
                return wide.movedim(0, to.dim).flatten(to.dim, to.dim + 1)
            if self.joined and not to.joined and to.dim == 0:
                dim = self.dim % wide.dim()  # (each model's size, not -1: a batch of 0 has no size to infer)
                own = wide.shape[dim] // n
                return wide.reshape(*wide.shape[:dim], n, own, *wide.shape[dim + 1 :]).movedim(dim, 0)
        raise ContractError(f"relaid: from {self} to {to}: one must be stacked on axis 0, the other joined")

    def spread(self, values: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
        """`values` (one per model, [N]) as a tensor that broadcasts against `wide`, each model's
        value over its part."""
        if self.model is not None:
            return values[self.model]
        self._per_model("settings")
        dim = self.dim % wide.dim()
        if self.joined:
            values = values.repeat_interleave(wide.shape[dim] // values.numel())
        return values.view(values.numel(), *(1,) * (wide.dim() - dim - 1))

    def norms(self, wide: torch.Tensor, n: int, p: float) -> torch.Tensor:
        """Each model's p-norm of its part of `wide`, [N] (zero for a model with no part)."""
        self._per_model("gradient norms")
        if self.model is not None:
            out = wide.new_zeros(n)
            out[self.model] = torch.linalg.vector_norm(wide, p)
            return out
        # joined: the axis holds model 0's rows, then model 1's...: moved first, they split into N rows as well
        blocks = wide.movedim(self.dim, 0).reshape(n, -1)
        norms: torch.Tensor = torch.linalg.vector_norm(blocks, p, dim=1)
        return norms

    def _per_model(self, what: str) -> None:
        if self.shared:
            raise ContractError(f"a tensor the N models share has no per-model {what}: keep it frozen")


STACKED = Layout()
JOINED = Layout(joined=True)
SHARED = Layout(shared=True)


def models_of(wide: Any, n: int) -> List[Any]:
    """Each of the N models' trees of a wide tree whose tensors are stacked on a leading N axis (a
    value that is no tensor is every model's)."""
    leaves, structure = trees.flat(wide)  # an object holding tensors (a DynamicCache) is rebuilt per model
    parts = [STACKED.parts(t, n) if isinstance(t, torch.Tensor) else [t] * n for t in leaves]
    return [trees.unflat(list(model), structure) for model in zip(*parts)]


def stacked_tree(values: Sequence[Any]) -> Any:
    """The N models' trees of one structure as one wide tree, each tensor stacked on a leading N axis."""
    flat = [trees.flat(v) for v in values]
    leaves = [STACKED.join(list(parts)) for parts in zip(*(leaves for leaves, _ in flat))]
    return trees.unflat(leaves, flat[0][1])


def held_once(values: Sequence[Any]) -> bool:
    """Whether the N models' tensors of one name are one frozen tensor, which a wide module holds
    once (SHARED) rather than stacking N copies: parameters that do not train (requires_grad
    False) that are one object, or bitwise equal (a frozen base each model deep-copied: the train
    mode's copies of the models, a factory's models built from one checkpoint). A parameter that
    trains is each model's (N trainings step it apart), and so is a buffer: forward may update it
    (BatchNorm's running statistics). Bit for bit, not by ==, which takes -0.0 for 0.0."""
    first = values[0]
    if not all(isinstance(v, nn.Parameter) and not v.requires_grad for v in values):
        return False
    return all(v is first or _bitwise_equal(v, first) for v in values[1:])


def held(values: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, Layout]:
    """The N models' tensors of one name as a wide module holds them, and how: one frozen tensor
    all hold (`held_once`), the models' own, SHARED; else stacked on a new leading axis, STACKED,
    a parameter staying a parameter that trains where the models' do."""
    if held_once(values):
        return values[0], SHARED
    stacked = STACKED.join([v.detach() for v in values])
    if isinstance(values[0], nn.Parameter):
        return nn.Parameter(stacked, requires_grad=values[0].requires_grad), STACKED
    return stacked, STACKED


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device) or a.device.type == "meta":
        return False
    bits = _BITS.get(a.element_size())
    return torch.equal(a.view(bits), b.view(bits)) if bits is not None else torch.equal(a, b)


# an integer dtype of each element size: a tensor viewed as one compares bit for bit (NaN equal to itself)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def second_names(named: Iterable[Tuple[str, object]]) -> Dict[str, str]:
    """Each second name of an object named twice (a weight tied to another, a layer registered
    under two paths) -> its first."""
    first: Dict[int, str] = {}
    aliases = {}
    for name, thing in named:
        if id(thing) in first:
            aliases[name] = first[id(thing)]
        else:
            first[id(thing)] = name
    return aliases


def named_tensors(module: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `module` by name, a tied one under each of its names."""
    return chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))


def tied_aliases(module: nn.Module) -> Dict[str, str]:
    """Each second name of a tied parameter or buffer (GPT-2's lm_head.weight, its embedding's
    table) -> its first name, the one named_parameters and named_buffers give."""
    return second_names(named_tensors(module))


class Slot(NamedTuple):
    """One tensor of a wide module: its name in one model, and where the N models' parts lie."""

    name: str
    layout: Layout


def slots_of(module: nn.Module) -> Dict[str, Slot]:
    """The module's slots (its `model_slots()`): a wide module of wide_tessera, or any that says."""
    declared = getattr(module, "model_slots", None)
    if not callable(declared):
        raise ContractError(f"{type(module).__name__} does not say how it holds the N models (model_slots)")
    slots: Dict[str, Slot] = declared()
    return slots


def prefixed(slots: Dict[str, Slot], wide_prefix: str, model_prefix: str) -> Dict[str, Slot]:
    """A submodule's slots as its parent names them: `wide_prefix` in the wide module, `model_prefix`
    in one model (either may be empty)."""

    def join(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    return {join(wide_prefix, k): Slot(join(model_prefix, s.name), s.layout) for k, s in slots.items()}


def persistent_tensors(module: nn.Module) -> List[str]:
    """The names of the module's own parameters and persistent buffers, not its submodules': what
    its state_dict holds of it."""
    params = [k for k, p in module._parameters.items() if p is not None]
    buffers = [k for k, b in module._buffers.items() if b is not None and k not in module._non_persistent_buffers_set]
    return params + buffers


def own_slots(module: nn.Module, layout: Layout, layouts: Optional[Dict[str, Layout]] = None) -> Dict[str, Slot]:
    """The slots of a wide module whose own tensors are named as in one model, each held by
    `layout` (or its entry in `layouts`), and of its children that say theirs, named alike."""
    layouts = layouts or {}
    slots = {k: Slot(k, layouts.get(k, layout)) for k in persistent_tensors(module)}
    for name, child in module.named_children():
        if child.state_dict():
            slots.update(prefixed(slots_of(child), name, name))
    return slots


def loop_slots(modules: Iterable[nn.Module], prefix: str) -> Dict[str, Slot]:
    """The slots of N modules held one per model (a ModuleList named `prefix`: a loop's): each
    module's tensors are all its model's."""
    return {f"{prefix}.{i}.{k}": Slot(k, Layout.own(i)) for i, m in enumerate(modules) for k in m.state_dict()}


def load_joined(wide: nn.Module, modules: Sequence[nn.Module]) -> nn.Module:
    """`wide` on the modules' device (and floating dtype), each tensor of its slots filled with
    the modules' tensors of that name, joined by its layout: what from_modules does."""
    ref = next((t for t in modules[0].state_dict().values() if t.is_floating_point()), None)
    if ref is not None:
        wide.to(device=ref.device, dtype=ref.dtype)
    state = wide.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, slot in slots_of(wide).items():
            state[name].copy_(slot.layout.join([operator.attrgetter(slot.name)(m) for m in modules]))
    return wide


def model_state_dicts(
    module: nn.Module, n: int, templates: Optional[Sequence[nn.Module]] = None
) -> List[Dict[str, Any]]:
    """The N models' state_dicts, read from the wide module's slots: each tensor a copy (a view
    would save all N models' storage with every one). Keys follow each template's state_dict
    (a weight tied to another, GPT-2's lm_head to its embedding, is given under both names);
    without templates, the slots' order."""
    states: List[Dict[str, Any]] = [{} for _ in range(n)]
    tensors = module.state_dict()
    for name, slot in slots_of(module).items():
        if slot.layout.shared:  # one copy, every model's
            once = tensors[name].clone()
            for state in states:
                state[slot.name] = once
            continue
        for i, part in enumerate(slot.layout.parts(tensors[name], n)):
            if part is not None:
                states[i][slot.name] = part.clone()
    if templates is None:
        return states
    return [_in_order(state, template) for state, template in zip(states, templates)]


def _in_order(state: Dict[str, Any], template: nn.Module) -> Dict[str, Any]:
    """`state` keyed and ordered as `template.state_dict()`: a key missing from it is a tied alias
    of one present (the same tensor in the template), given its value."""
    first = tied_aliases(template)
    given = {first.get(key, key): key for key in state}  # a tensor, by its first name -> its key in `state`
    ordered = {}
    for key in template.state_dict(keep_vars=True):
        if first.get(key, key) not in given:
            raise ContractError(f"the wide module holds no {key!r} of the models")
        ordered[key] = state[given[first.get(key, key)]]
    return ordered
