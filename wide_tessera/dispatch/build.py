"""What `fuse` gives back: a Fused, running the wide module a decision names or the N modules
as a loop, and carrying the decision that chose it.

`build(decision, modules, make)` is the second half of dispatch: `dispatch.table.decide` says
what to run (pure: a table and a case in, an answer out), this builds it. `Trials` says how an
op's strategies are built and what each needs: fuse(), a first call's measurement and the
transformers integration read the same one.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Type

from torch import nn

from ..core import trees
from ..core.capabilities import Needs
from ..core.errors import WideTesseraError
from ..core.job import params_text
from ..core.layout import Slot, loop_slots, model_state_dicts, prefixed, slots_of
from ..ops.base import WideOp, wide_module
from ..ops.registry import outside_strategies
from ..widen.custom import CUSTOM_STRATEGIES, custom_wide
from ..widen.layers import LayerChoice
from .reached import Reached
from .table import Case, Match

__all__ = ["Fused", "FusedInput", "LoopedModules", "DispatchDecision", "Trials", "op_trials", "custom_trials", "build"]

# A strategy's wide module of N modules: build(modules, strategy).
Make = Callable[[List[nn.Module], str], nn.Module]


class Trials(NamedTuple):
    """A module kind's strategies, how one is built from N modules, and what each needs to run;
    `outside`: the strategies added to it from outside (register_strategy), which a table measured
    by `tune` may name and `make` builds, but a first call does not try."""

    strategies: Sequence[str]
    make: Make
    needs: Dict[str, Needs]
    outside: Sequence[str] = ()

    def known(self) -> List[str]:
        """Every strategy a table entry may name for this kind of module."""
        return [*self.strategies, *self.outside]


def op_trials(cls: Type[WideOp]) -> Trials:
    """A registered op's strategies, built by its own from_modules (outside strategies included)."""
    return Trials(
        cls.BENCHMARK_STRATEGIES, partial(wide_module, cls), cls.strategy_needs(), list(outside_strategies(cls))
    )


def custom_trials(randomness: str, choice: Optional[LayerChoice] = None) -> Trials:
    """Any other module's: vmap and surgery, as benchmark_custom measures them (surgery's layers
    run as N calls where `choice` says)."""
    return Trials(CUSTOM_STRATEGIES, partial(custom_wide, randomness=randomness, choice=choice), {})


@dataclass(frozen=True)
class DispatchDecision:
    """Why `fuse` built what it built: readable with print(fused.decision).

    case: what was asked (op, device, dtype, mode, parameters, N); match: the table's answer
    (the decision, its nearest entries and their distance); table: the file it came from (None:
    a table object).
    """

    case: Case
    match: Match
    table: Optional[str]

    @property
    def fused(self) -> bool:
        return self.match.fuse

    @property
    def strategy(self) -> Optional[str]:
        """The wide strategy that runs (None: the loop)."""
        return self.match.strategy

    def __str__(self) -> str:
        c, m = self.case, self.match
        what = f"fuse with {self.strategy!r}" if self.fused else "loop over the modules (not fused)"
        lines = [
            f"{what}: {c.op} x{c.n}, {params_text(c.params) or 'no parameters given'}, dtype={c.dtype}, "
            f"mode={c.mode}, on {c.device_name}",
            f"  because: {m.reason}",
        ]
        for e in m.entries:
            apart = [f"{k} {v} (measured {e.params[k]})" for k, v in c.params.items() if e.params.get(k) != v]
            how_far = f"distance {m.distance:.3f}: " + (", ".join(apart) if apart else "the same parameters")
            lines.append(f"  entry: {e.describe()}; {how_far}")
        lines.append(f"  table: {self.table or 'given as an object'}")
        lines += [f"  note: {note}" for note in m.notes]
        return "\n".join(lines)


def one_each(inputs: Sequence[Any], n: int) -> Tuple[Any, ...]:
    """The N inputs of a loop, as its packed value: one per module."""
    if not isinstance(inputs, (list, tuple)) or len(inputs) != n:
        raise WideTesseraError(f"pack needs a list of {n} inputs, one per module")
    return tuple(inputs)


class LoopedModules(nn.Module):
    """The N modules called one by one: `pack` keeps the N inputs as they are (no copy), `unpack`
    gives the N outputs. The packed value is opaque: pass what `pack` gives to the module, and its
    output to `unpack`."""

    def __init__(self, modules: Sequence[nn.Module]):
        super().__init__()
        self.models = nn.ModuleList(modules)

    def pack(self, inputs: Sequence[Any]) -> Tuple[Any, ...]:
        return one_each(inputs, len(self.models))

    def unpack(self, output: Tuple[Any, ...]) -> List[Any]:
        if not isinstance(output, tuple) or len(output) != len(self.models):  # a tensor's rows are not N outputs
            raise WideTesseraError(
                f"unpack takes what forward gives: a tuple of {len(self.models)} outputs, one per module; got "
                f"{_described(output)}"
            )
        return list(output)

    def forward(self, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if not isinstance(inputs, tuple) or len(inputs) != len(self.models):  # a tensor would pair rows with modules
            raise WideTesseraError(
                f"forward takes what pack gives: a tuple of {len(self.models)} inputs, one per module"
            )
        return tuple(trees.call_each(self.models, inputs))

    def model_slots(self) -> Dict[str, Slot]:
        """Each module's own tensors, all of them that model's."""
        return loop_slots(self.models, "models")


@dataclass(frozen=True)
class FusedInput:
    """What `Fused.pack` gives and its forward takes: the N models' inputs as the module that runs
    them packs them, with the N they are for. Anything else given to the forward (a stack of the N
    inputs without pack, the list unpacked, a value packed for another N) is one error naming what
    to give: a loop took a stack's rows for its N inputs and returned N outputs, and a wide module
    raised torch's own error about a shape."""

    value: Any
    n: int


def _described(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__} of shape {list(shape)}" if shape is not None else f"a {type(value).__name__}"


class Fused(nn.Module):
    """What `fuse` returns: N modules of one kind as one module.

    `runs` is what its forward runs: a strategy's wide module, or the N modules as a loop
    (LoopedModules). It owns the parameters that run: `parameters()`, `state_dict()`, `.to()`,
    `.train()` and `requires_grad_()` act on `runs`, so an optimizer over `fused.parameters()`
    trains what runs, whichever strategy won. A wide module holds a copy of the modules' weights,
    but for a frozen tensor all of them hold (core.layout.held_once), which it holds once, the
    models' own: `state_dicts()` and `unfuse()` give the N models back, current weights and
    buffers included, the models given back holding that one tensor.
    `pack(inputs)`, `forward(packed)` and `unpack(output)` are the runner's; `decision` says what
    decided (print it).
    """

    def __init__(self, modules: Sequence[nn.Module], runs: nn.Module, decision: DispatchDecision):
        super().__init__()
        self.runs, self.decision, self.n = runs, decision, len(modules)
        self._reached = Reached(self.n)
        # the modules given, kept as templates of unfuse() (a tuple: not submodules; the loop's own are in runs)
        self._given: Tuple[nn.Module, ...] = tuple(modules)

    @property
    def strategy(self) -> Optional[str]:
        """The wide strategy that runs (None: the loop)."""
        return self.decision.strategy

    def pack(self, inputs: Sequence[Any]) -> FusedInput:
        """The N models' inputs (a list of N, one per model) as this module's forward takes them."""
        if not isinstance(inputs, (list, tuple)) or len(inputs) != self.n:
            got = f"{len(inputs)}" if isinstance(inputs, (list, tuple)) else _described(inputs)
            raise WideTesseraError(f"pack: give a list of {self.n} inputs, one per model; got {got}")
        return FusedInput(self._pack(list(inputs)), self.n)

    def forward(self, packed: FusedInput) -> Any:
        if not isinstance(packed, FusedInput) or packed.n != self.n:
            got = f"a value packed for {packed.n} models" if isinstance(packed, FusedInput) else _described(packed)
            raise WideTesseraError(
                f"call it with what its pack gives, fused(fused.pack(inputs)) of {self.n} inputs; got {got}"
            )
        if not self._runs_the_loop() and all(p.grad is None for p in self.parameters()):
            # every gradient None, however it was set so (a parent's zero_grad(), p.grad = None, or
            # torch.autograd.grad since, which fills no .grad): no backward has reached a model
            self._reached.clear()
        output = self._forward(packed.value)
        return output if self._runs_the_loop() else self._reached.watch(output, self._unpack)

    def unpack(self, output: Any) -> List[Any]:
        """The N models' outputs of what this module's forward returned."""
        outputs = self._unpack(output)
        if len(outputs) != self.n:
            raise WideTesseraError(
                f"unpack: give what this module's forward returned; this value holds {len(outputs)} outputs, not "
                f"{self.n}"
            )
        return outputs if self._runs_the_loop() else self._reached.each(output, outputs)

    def _runs_the_loop(self) -> bool:
        """The N modules run one by one: a model left out of the loss has no gradient of its own."""
        return isinstance(self.runs, LoopedModules)

    def models_reached(self) -> Optional[Set[int]]:
        """The models whose outputs a backward reached since the gradients were set to None (None:
        not known, every model counts by its gradient): what wide_tessera.optim steps."""
        return None if self._runs_the_loop() else self._reached.models

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if set_to_none:
            self._reached.clear()

    # what `runs` does with the N inputs: a subclass that packs otherwise (FirstCall) says so here
    def _pack(self, inputs: List[Any]) -> Any:
        runs: Any = self.runs  # a wide module or the loop: pack, call, unpack (nn.Module's typing cannot say so)
        return runs.pack(inputs)

    def _forward(self, packed: Any) -> Any:
        return self.runs(packed)

    def _unpack(self, output: Any) -> List[Any]:
        runs: Any = self.runs
        return list(runs.unpack(output))

    def model_slots(self) -> Dict[str, Slot]:
        return prefixed(slots_of(self.runs), "runs", "")

    def parameter_names(self) -> List[str]:
        """One model's parameter names, in the order its `parameters()` gives them (and a torch
        optimizer over them indexes its state)."""
        return [name for name, _ in self._given[0].named_parameters()]

    def state_dicts(self) -> List[Dict[str, Any]]:
        """The N models' state_dicts, as `load_state_dict` of the modules' class takes them: their
        current parameters and persistent buffers (BatchNorm's running statistics), each a copy."""
        return model_state_dicts(self.runs, self.n, self._given)

    def unfuse(self, into: Optional[Sequence[nn.Module]] = None) -> List[nn.Module]:
        """The N models, each a module of the class given to fuse() holding its current weights, on
        the device they are on now, in this module's train or eval mode; `into`: load them into
        these N modules instead (the ones given to fuse(), say), and return them."""
        if into is None:
            targets = [copy.deepcopy(m, self._held_once(m)) for m in self._given]
        else:
            targets = list(into) if isinstance(into, (list, tuple, nn.ModuleList)) else []
            if len(targets) != self.n or any(type(t) is not type(self._given[0]) for t in targets):
                raise WideTesseraError(
                    f"unfuse(into=...): give {self.n} {type(self._given[0]).__name__} modules, one per model"
                )
        for target, state in zip(targets, self.state_dicts()):
            if into is None:
                _held_as(target, state)
            target.load_state_dict(state)
            target.train(self.training)
        self._frozen_as_runs(targets)
        return targets

    def _held_once(self, model: nn.Module) -> Dict[int, Any]:
        """A deepcopy's memo giving the copy of `model` the frozen tensors `runs` holds once, as
        they are: N copies of a LoRA base given back would be N times its memory."""
        return {
            id(operator.attrgetter(slot.name)(model)): operator.attrgetter(name)(self.runs)
            for name, slot in slots_of(self.runs).items()
            if slot.layout.shared
        }

    def _frozen_as_runs(self, models: List[nn.Module]) -> None:
        """Each model's parameter frozen (requires_grad False) where the tensor that holds it is."""
        params = dict(self.runs.named_parameters())
        for name, slot in slots_of(self.runs).items():
            if name in params:
                for i, model in enumerate(models):
                    if slot.layout.model in (None, i):
                        model.get_parameter(slot.name).requires_grad_(params[name].requires_grad)


def _held_as(model: nn.Module, state: Dict[str, Any]) -> None:
    """`model`'s tensors on the device and in the dtype the fused module holds them in now (after
    a .to(), say): each its state's, and a tensor the state lacks (a buffer not saved: rotary
    tables) on that device, and in the floating dtype of the state's where it has one. One dtype
    for all, the first tensor's, made a model with a float64 buffer float64 throughout, and it
    failed on its float32 input."""
    tensors = list(state.values())
    floating = {t.dtype for t in tensors if t.is_floating_point()}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        held = state.get(name)
        if held is not None:
            device, dtype = held.device, held.dtype
        else:
            device = tensors[0].device if tensors else t.device
            dtype = next(iter(floating)) if t.is_floating_point() and len(floating) == 1 else t.dtype
        if (t.device, t.dtype) != (device, dtype):
            t.data = t.data.to(device=device, dtype=dtype)


def build(decision: DispatchDecision, modules: Sequence[nn.Module], make: Make, forced: bool = False) -> Fused:
    """The decision's wide module of `modules` (made by `make`), or the loop, as a Fused whose
    `decision` is the one that holds. A wide module that cannot be built here falls back to the
    loop, the reason added (a dispatcher in a model's forward path never breaks it), unless the
    strategy was `forced`: then the error is the caller's."""
    match = decision.match
    runs: nn.Module = LoopedModules(modules)
    if match.fuse and match.strategy is not None:
        try:
            runs = make(list(modules), match.strategy)
        except Exception as e:  # noqa: BLE001  fall back, and say why
            if forced:
                raise
            match = replace(match, fuse=False, strategy=None, reason=f"{match.reason}; but building it failed: {e}")
    notes = (*match.notes, *layer_notes(runs, len(modules)))
    return Fused(modules, runs, replace(decision, match=replace(match, notes=notes)))


def layer_notes(runs: nn.Module, n: int) -> Tuple[str, ...]:
    """A note per layer of a model fused by surgery that runs as `n` calls, and why (its `unfused`)."""
    unfused: Dict[str, str] = getattr(runs, "unfused", {})
    return tuple(f"layer {path} runs as {n} calls: {why}" for path, why in unfused.items())
