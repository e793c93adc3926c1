"""The plain Python values a module keeps as its attributes: a call counter (`self.calls += 1`), a
phase (`self.phase = "main"`), a list or dict of steps seen. Two questions are asked of them, here
in one place: what a first call's measurement must put back (measurement.modes: a counter was left
at 622 after one), and whether a forward changed one, which a captured graph cannot follow
(widen.capture: a warm-up kept in the module ran as the capture's call did, 0.67 off)."""

from __future__ import annotations

import copy
import numbers
from typing import Any, Dict

import torch
from torch import nn

__all__ = ["plain_values", "is_plain_value"]

# What nn.Module itself keeps (`training`, which train() and eval() set; its dicts of parameters,
# buffers, submodules and hooks) is not a value of the model's.
_MODULE_OWN = frozenset(vars(nn.Module()))


def plain_values(module: nn.Module) -> Dict[str, Any]:
    """A copy of each plain value `module` itself keeps (not its submodules'), by name."""
    return copy.deepcopy({name: value for name, value in vars(module).items() if is_plain_value(name, value)})


def is_plain_value(name: str, value: Any) -> bool:
    """Whether a module's attribute `name` holding `value` is one of its plain values."""
    return name not in _MODULE_OWN and not name.startswith("__") and _plain(value)


def _plain(value: Any) -> bool:
    """A number (NumPy's too), a string, or a list, tuple or dict holding only those."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return isinstance(value, (numbers.Number, str)) and not isinstance(value, torch.SymInt)
