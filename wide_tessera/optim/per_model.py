"""A setting given for N models: one value for all, or a sequence of one per model; and what a
module that holds N models says of them (how many; one model's parameter names)."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Set

from torch import nn

from ..core.errors import WideTesseraError

__all__ = ["per_model", "models_in", "models_reached", "parameter_names", "number"]


def per_model(name: str, value: Any, n: int, check: Callable[[str, Any], Any], pairs: bool = False) -> List[Any]:
    """`value` for each of the N models: one value for all, or a list or tuple of N, one per model
    (where a value is itself a pair, Adam's betas, `pairs`: a sequence of N pairs). Each is passed
    through `check(name, value)`, which returns it checked."""
    many = isinstance(value, (list, tuple)) and (not pairs or all(isinstance(v, (list, tuple)) for v in value))
    if not many:
        return [check(name, value)] * n
    if len(value) != n:
        raise WideTesseraError(f"{name}={value!r}: give one value, or a sequence of {n}, one per model")
    return [check(f"{name}[{i}]", v) for i, v in enumerate(value)]


def number(low: float, high: float = math.inf, *, open_high: bool = False) -> Callable[[str, Any], float]:
    """A check of a finite number in [low, high] (or [low, high) where `open_high`)."""

    def check(name: str, value: Any) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and low <= value and (value < high if open_high else value <= high):
            return float(value)
        bound = f"[{low:g}, {high:g}{')' if open_high else ']'}" if math.isfinite(high) else f"at least {low:g}"
        raise WideTesseraError(f"{name}={value!r}: give a number {bound}")

    return check


def models_in(module: nn.Module) -> int:
    """How many models `module` holds: what fuse() returned, or a wide module of wide_tessera."""
    n = getattr(module, "n", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or not callable(getattr(module, "model_slots", None)):
        raise WideTesseraError(
            f"{type(module).__name__} is not N models as one: give what wide_tessera.fuse() returned (or a wide module "
            "of wide_tessera)"
        )
    return n


def parameter_names(module: nn.Module) -> Optional[List[str]]:
    """One model's parameter names in its own order (what a torch optimizer's state indexes), where
    the module knows the models' class (fuse()'s result); None where it does not."""
    names = getattr(module, "parameter_names", None)
    return list(names()) if callable(names) else None


def models_reached(module: nn.Module) -> Optional[Set[int]]:
    """The models whose outputs a backward reached since the gradients were set to None, where the
    module records it (fuse()'s result: a model left out of the loss is skipped, as torch skips a
    parameter whose grad is None); None where it does not: every model counts by its gradient."""
    reached = getattr(module, "models_reached", None)
    return reached() if callable(reached) else None
