"""What `fuse` gives back: the wide module a decision names, or the N modules as a loop, each
carrying the decision that chose it.

`build(decision, modules, make)` is the second half of dispatch: `dispatch.table.decide` says
what to run (pure: a table and a case in, an answer out), this builds it. `Trials` says how an
op's strategies are built and what each needs: fuse(), a first call's measurement and the
transformers integration read the same one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type

from torch import nn

from ..core import trees
from ..core.capabilities import Needs
from ..core.errors import WideTesseraError
from ..core.job import params_text
from ..ops.base import WideOp, wide_module
from ..widen.custom import CUSTOM_STRATEGIES, custom_wide
from .table import Case, Match

__all__ = ["ModuleGroup", "LoopedModules", "DispatchDecision", "Trials", "op_trials", "custom_trials", "build"]

# A strategy's wide module of N modules: build(modules, strategy).
Make = Callable[[List[nn.Module], str], nn.Module]


class Trials(NamedTuple):
    """A module kind's strategies, how one is built from N modules, and what each needs to run."""

    strategies: Sequence[str]
    make: Make
    needs: Dict[str, Needs]


def op_trials(cls: Type[WideOp]) -> Trials:
    """A registered op's strategies, built by its own from_modules (outside strategies included)."""
    return Trials(cls.BENCHMARK_STRATEGIES, partial(wide_module, cls), cls.strategy_needs())


def custom_trials(randomness: str) -> Trials:
    """Any other module's: vmap and surgery, as benchmark_custom measures them."""
    return Trials(CUSTOM_STRATEGIES, partial(custom_wide, randomness=randomness), {})


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


class ModuleGroup(nn.Module):
    """N modules behind the wide modules' interface: `pack` keeps the N inputs as they are (no
    copy), `unpack` gives the N outputs. The packed value is opaque: pass what `pack` gives to the
    module, and its output to `unpack`. `decision` says what runs, and why."""

    decision: DispatchDecision

    def __init__(self, modules: Sequence[nn.Module]):
        super().__init__()
        self.models = nn.ModuleList(modules)

    def pack(self, inputs: Sequence[Any]) -> Tuple[Any, ...]:
        if not isinstance(inputs, (list, tuple)) or len(inputs) != len(self.models):
            raise WideTesseraError(f"pack needs a list of {len(self.models)} inputs, one per module")
        return tuple(inputs)

    def unpack(self, output: Tuple[Any, ...]) -> List[Any]:
        return list(output)


class LoopedModules(ModuleGroup):
    """The N modules called one by one: what `fuse` gives where measurements do not say fuse."""

    def forward(self, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if not isinstance(inputs, tuple) or len(inputs) != len(self.models):  # a tensor would pair rows with modules
            raise WideTesseraError(
                f"forward takes what pack gives: a tuple of {len(self.models)} inputs, one per module"
            )
        return tuple(trees.call_each(self.models, inputs))


def build(decision: DispatchDecision, modules: Sequence[nn.Module], make: Make) -> Tuple[nn.Module, DispatchDecision]:
    """The decision's wide module of `modules` (made by `make`), or the loop, and the decision
    that holds, also set as the module's `decision` attribute. A wide module that cannot be built
    here falls back to the loop, the reason added: a dispatcher in a model's forward path never
    breaks it."""
    match = decision.match
    built: nn.Module = LoopedModules(modules)
    if match.fuse and match.strategy is not None:
        try:
            built = make(list(modules), match.strategy)
        except Exception as e:  # noqa: BLE001  fall back, and say why
            match = replace(match, fuse=False, strategy=None, reason=f"{match.reason}; but building it failed: {e}")
    held = replace(decision, match=match)
    built.decision = held  # type: ignore[assignment]  # a plain attribute: nn.Module's typing knows only tensors
    return built, held
