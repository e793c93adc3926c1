"""Maps op names to op classes; `register` lets users add their own."""

from __future__ import annotations

from typing import Callable, Dict, List, TypeVar

from ..errors import unknown

__all__ = ["REGISTRY", "register", "get_op", "op_names"]

REGISTRY: Dict[str, type] = {}
T = TypeVar("T", bound=type)


def register(name: str, *aliases: str) -> Callable[[T], T]:
    """Class decorator: make an op class reachable as `name` (and its aliases)."""

    def decorate(cls: T) -> T:
        for key in (name, *aliases):
            if key in REGISTRY and REGISTRY[key] is not cls:
                raise ValueError(f"op name {key!r} is already registered to {REGISTRY[key].__name__}")
            REGISTRY[key] = cls
        cls.NAME = name
        return cls

    return decorate


def get_op(name: str) -> type:
    if name not in REGISTRY:
        raise unknown("op", name, sorted(REGISTRY))
    return REGISTRY[name]


def op_names() -> List[str]:
    """Each op once, by its own name (aliases left out), in registration order."""
    return list(dict.fromkeys(cls.NAME for cls in REGISTRY.values()))
