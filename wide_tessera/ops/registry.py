"""Maps op names to op classes; `register` lets users add their own ops, `register_strategy` strategies."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Type, TypeVar

from ..core.capabilities import Needs
from ..core.errors import WideTesseraError, one_line, unknown
from ..core.roles import RESERVED_NAMES

if TYPE_CHECKING:
    from .base import WideOp

__all__ = [
    "REGISTRY",
    "RESERVED_STRATEGY_NAMES",
    "register",
    "register_strategy",
    "outside_strategies",
    "OutsideStrategy",
    "get_op",
    "op_names",
    "import_ops",
    "ENTRY_POINT_GROUP",
]

# Installed packages offer ops (and strategies) here: importing the entry point's module
# runs its @register and register_strategy calls.
ENTRY_POINT_GROUP = "wide_tessera.ops"

REGISTRY: Dict[str, Type["WideOp"]] = {}
T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class OutsideStrategy:
    """A strategy added to an op from outside its class (see `register_strategy`)."""

    build: Callable[[Any], Callable[..., Any]]
    needs: Optional[Needs] = None


# Names the runner gives its own callables: no strategy, an op's own or an outside one, may take them.
RESERVED_STRATEGY_NAMES = RESERVED_NAMES

# op class -> strategy name -> the strategy, in registration order
_OUTSIDE: Dict[type, Dict[str, OutsideStrategy]] = {}


def register(name: str, *aliases: str) -> Callable[[T], T]:
    """Class decorator: make an op class reachable as `name` (and its aliases).

    The class is checked now (its `check_contract`), so a broken op fails where it is
    defined, not at its first benchmark.
    """
    for key in (name, *aliases):
        if not isinstance(key, str) or not key:
            raise WideTesseraError(f"register: op name {key!r}: give a non-empty string")

    def decorate(cls: T) -> T:
        # Duck-typed: importing WideOp here would make the registry depend on the ops that use it.
        if not isinstance(cls, type) or not callable(getattr(cls, "check_contract", None)):
            raise WideTesseraError(f"register({name!r}): {cls!r} is not a WideOp subclass")
        cls.check_contract()
        for key in (name, *aliases):
            if key in REGISTRY and REGISTRY[key] is not cls:
                raise WideTesseraError(f"op name {key!r} is already registered to {REGISTRY[key].__name__}")
        for key in (name, *aliases):
            REGISTRY[key] = cls
        cls.NAME = name
        return cls

    return decorate


def register_strategy(
    op: str, name: str, build: Optional[Callable[[Any], Callable[..., Any]]] = None, needs: Optional[Needs] = None
) -> Any:
    """Add strategy `name` to the registered op `op` from outside its class (a kernel, say).

    `build(wide)` gets the op's wide module of its default strategy, which holds the N
    models' stacked parameters (gemm's `wide.weight` [N, out, in] and `wide.bias` [N, out]),
    and returns a function of the op's wide input (its `pack` layout) giving the wide
    output (its `unpack` layout). The strategy is checked, timed and reported exactly like
    the op's own. `needs` (capabilities.Needs) says what it needs from the run, so it is
    skipped with the reason elsewhere. Without `build`, a decorator:
    `@register_strategy('gemm', 'my_kernel')` on the build function.
    """
    cls = get_op(op)
    if build is None:
        return lambda fn: register_strategy(op, name, fn, needs) or fn
    if not isinstance(name, str) or not name.isidentifier():
        raise WideTesseraError(f"register_strategy({op!r}, {name!r}): give a strategy name that is an identifier")
    taken = [*RESERVED_STRATEGY_NAMES, *cls.BENCHMARK_STRATEGIES]
    if name in taken:
        raise WideTesseraError(f"register_strategy({op!r}, {name!r}): {cls.NAME} already has a strategy {name!r}")
    if not callable(build):
        raise WideTesseraError(f"register_strategy({op!r}, {name!r}): build={build!r} is not callable")
    if needs is not None and not isinstance(needs, Needs):
        raise WideTesseraError(f"register_strategy({op!r}, {name!r}): needs={needs!r}: give a capabilities.Needs")
    outside = _OUTSIDE.setdefault(cls, {})
    if name in outside and outside[name].build is not build:
        raise WideTesseraError(
            f"register_strategy({op!r}, {name!r}): {cls.NAME} already has an outside strategy {name!r}"
        )
    outside[name] = OutsideStrategy(build, needs)
    return None


def outside_strategies(cls: type) -> Dict[str, OutsideStrategy]:
    """The strategies added to op class `cls` from outside it, by name."""
    return dict(_OUTSIDE.get(cls, {}))


def import_ops(modules: Sequence[str]) -> None:
    """Import `modules` (dotted names, found from the current directory too, as `python -m`
    finds them) so that their @register ops and register_strategy calls take effect."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except (Exception, SystemExit) as e:  # noqa: BLE001  its own error, in one line; sys.exit(3) is no exit status of ours
            raise WideTesseraError(f"cannot import {module!r}: {one_line(e)}") from None


_plugins_loaded = False


def _load_entry_points() -> None:
    """Import every installed package's entry point in ENTRY_POINT_GROUP, once, on first use of the registry."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            point.load()
        except (Exception, SystemExit) as e:  # noqa: BLE001  a plugin's own error, in one line
            raise WideTesseraError(
                f"the {ENTRY_POINT_GROUP} entry point {point.name!r} ({point.value}) failed to load: {one_line(e)}"
            ) from None


def get_op(name: str) -> Type["WideOp"]:
    _load_entry_points()
    if not isinstance(name, str):
        raise WideTesseraError(f"op {name!r}: give one op name as a string (valid: {', '.join(sorted(REGISTRY))})")
    if name not in REGISTRY:
        raise unknown("op", name, sorted(REGISTRY))
    return REGISTRY[name]


def op_names() -> List[str]:
    """Each op once, by its own name (aliases left out), in registration order."""
    _load_entry_points()
    return list(dict.fromkeys(cls.NAME for cls in REGISTRY.values()))
