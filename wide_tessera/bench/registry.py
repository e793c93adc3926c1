"""Maps op names to op classes; `register` lets users add their own."""

from __future__ import annotations

from typing import Callable, Dict, List, TypeVar

from ..errors import WideTesseraError, unknown

__all__ = ["REGISTRY", "register", "get_op", "op_names"]

REGISTRY: Dict[str, type] = {}
T = TypeVar("T", bound=type)


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


def get_op(name: str) -> type:
    if not isinstance(name, str):
        raise WideTesseraError(f"op {name!r}: give one op name as a string (valid: {', '.join(sorted(REGISTRY))})")
    if name not in REGISTRY:
        raise unknown("op", name, sorted(REGISTRY))
    return REGISTRY[name]


def op_names() -> List[str]:
    """Each op once, by its own name (aliases left out), in registration order."""
    return list(dict.fromkeys(cls.NAME for cls in REGISTRY.values()))
