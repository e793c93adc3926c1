"""A setting given for N models: one value for all, or a sequence of one per model (a list, a
tuple, a NumPy array or a tensor); a pair of settings (Adam's betas) given per coefficient or per
model; and what a module that holds N models says of them (how many; one model's parameter names)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, List, Optional, Set, Tuple

import torch
from torch import nn

from ..core.errors import WideTesseraError

__all__ = ["per_model", "per_model_pairs", "models_in", "models_reached", "parameter_names", "number", "flag"]


def per_model(name: str, value: Any, n: int, check: Callable[[str, Any], Any]) -> List[Any]:
    """`value` for each of the N models: one value for all, or a sequence of N, one per model (a
    list, a tuple, or a NumPy array or tensor of one axis, as HFTA's settings are). Each is passed
    through `check(name, value)`, which returns it checked."""
    values = _sequence(value)
    if values is None:
        return [check(name, value)] * n
    if len(values) != n:
        raise WideTesseraError(f"{name}={value!r}: give one value, or a sequence of {n}, one per model")
    return [check(f"{name}[{i}]", v) for i, v in enumerate(values)]


def per_model_pairs(name: str, value: Any, n: int, check: Callable[[str, Any], Any]) -> List[Tuple[Any, Any]]:
    """A pair of settings (Adam's betas) for each of the N models: given per coefficient, each one
    value or N (`(0.9, 0.999)`; HFTA's `([0.9, 0.8, ...], 0.999)`), or as N pairs. Two models'
    `((a, b), (c, d))` reads both ways: where the readings differ, refused naming both (read as
    two pairs, model 0 got beta2 0.8 from HFTA's `([0.9, 0.8], [0.999, 0.99])`, silently)."""
    values = _sequence(value)
    pairs = [_sequence(v) for v in values] if values is not None else []
    by_model = len(pairs) == n and all(p is not None and len(p) == 2 for p in pairs)
    by_coefficient = values is not None and len(values) == 2 and all(p is None or len(p) == n for p in pairs)
    if not (by_model or by_coefficient):
        raise WideTesseraError(
            f"{name}={value!r}: give a pair (beta1, beta2), each one number or {n}, one per model, or {n} pairs"
        )
    assert values is not None
    models = [(check(f"{name}[{i}][0]", p[0]), check(f"{name}[{i}][1]", p[1])) for i, p in enumerate(pairs) if p]
    if not by_coefficient:
        return models
    read = list(zip(*(per_model(f"{name}[{j}]", values[j], n, check) for j in range(2))))
    if by_model and models != read:
        raise WideTesseraError(
            f"{name}={value!r} reads two ways for 2 models: as 2 pairs (model 0 {models[0]}, model 1 "
            f"{models[1]}) or as (beta1s, beta2s) (model 0 {read[0]}, model 1 {read[1]}); give one pair for "
            "both, or set model i's after: opt.param_groups[i]['betas'] = (beta1, beta2)"
        )
    return read


def _sequence(value: Any) -> Optional[List[Any]]:
    """`value`'s items where it is a sequence of settings (a list, a tuple, a NumPy array or a
    tensor of one axis); None where it is one setting."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        if getattr(value, "ndim", 0) == 1:
            return list(value.tolist())
    return None


def as_number(value: Any) -> Optional[float]:
    """`value` as a Python float where torch takes it as a number: an int or float, a NumPy scalar
    or array of one element, a tensor of one element (not a bool); else None."""
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
        if getattr(value, "size", None) == 1 or (isinstance(value, torch.Tensor) and value.numel() == 1):
            value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def number(
    low: float, high: float = math.inf, *, open_high: bool = False, infinite: bool = False
) -> Callable[[str, Any], float]:
    """A check of a number in [low, high] (or [low, high) where `open_high`), finite unless
    `infinite` (clipping's max_norm, torch's no limit), given as any number torch takes."""

    def check(name: str, value: Any) -> float:
        x = as_number(value)
        if x is not None and (math.isfinite(x) or (infinite and x == math.inf)):
            if low <= x and (x < high if open_high else x <= high):
                return x
        bound = f"[{low:g}, {high:g}{')' if open_high else ']'}" if math.isfinite(high) else f"at least {low:g}"
        raise WideTesseraError(f"{name}={value!r}: give a number {bound}{' or inf' if infinite else ''}")

    return check


def flag(name: str, value: Any) -> bool:
    """A check of a setting that is on or off (SGD's nesterov, Adam's amsgrad)."""
    if not isinstance(value, bool):
        raise WideTesseraError(f"{name}={value!r}: give True or False")
    return value


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
