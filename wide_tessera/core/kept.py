"""The plain Python values a module keeps as its attributes: a call counter (`self.calls += 1`), a
phase (`self.phase = "main"`), a list or dict of steps seen. Two questions are asked of them, here
in one place: what a first call's measurement must put back (measurement.modes: a counter was left
at 622 after one), and whether a forward changed one, which a captured graph cannot follow
(widen.capture: a warm-up kept in the module ran as the capture's call did, 0.67 off)."""

from __future__ import annotations

import copy
import numbers
from typing import Any, Callable, Dict, Sequence

import torch
from torch import nn

__all__ = ["plain_values", "is_plain_value", "putting_back"]

# What nn.Module itself keeps (`training`, which train() and eval() set; its dicts of parameters,
# buffers, submodules and hooks) is not a value of the model's.
_MODULE_OWN = frozenset(vars(nn.Module()))


def plain_values(module: nn.Module) -> Dict[str, Any]:
    """A copy of each plain value `module` itself keeps (not its submodules'), by name."""
    return copy.deepcopy({name: value for name, value in vars(module).items() if is_plain_value(name, value)})


def is_plain_value(name: str, value: Any) -> bool:
    """Whether a module's attribute `name` holding `value` is one of its plain values."""
    return name not in _MODULE_OWN and not name.startswith("__") and _plain(value)


def putting_back(modules: Sequence[nn.Module]) -> Callable[[], None]:
    """A function that puts back the plain values the modules keep now, each the object it is
    (a list the user also holds, a dict two modules share) holding what it holds now; one a
    module sets later is taken away. A copy per module broke both: the user's log no longer the
    module's, and a schedule shared by a parent and its child split in two, the child's stuck at
    its first step (0.34 further off the separate models at every call)."""
    held = [(m, dict(vars(m))) for m in modules]  # every attribute, as the object it is
    plain = [{k: v for k, v in attributes.items() if is_plain_value(k, v)} for _, attributes in held]
    contents = copy.deepcopy(plain)  # one copy of all: what is shared stays shared

    def put_back() -> None:
        fresh = copy.deepcopy(contents)
        for (m, attributes), values, now in zip(held, plain, fresh):
            for key in [k for k, v in vars(m).items() if k not in values and is_plain_value(k, v)]:
                if key in attributes:  # (a None the forward set to a number)
                    m.__dict__[key] = attributes[key]
                else:
                    del m.__dict__[key]
            for key, value in values.items():
                _refill(value, now[key])
                m.__dict__[key] = value

    return put_back


def _refill(container: Any, contents: Any) -> None:
    """`container` (a list, dict or set the forward may have changed in place) holding `contents` again."""
    if isinstance(container, list):
        container[:] = contents
    elif isinstance(container, (dict, set)):
        container.clear()
        container.update(contents)


def _plain(value: Any) -> bool:
    """A number (NumPy's too), a string, or a list, tuple, set or dict holding only those."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return isinstance(value, (numbers.Number, str)) and not isinstance(value, torch.SymInt)
