"""Checks of values a user gives, each failing with one line that names the value and what is valid.

Run before anything is measured: a bad value found after an hour of measuring loses the hour.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Type, TypeVar, Union

from .errors import WideTesseraError

__all__ = ["MAX_SEED", "MAX_THREADS", "check_number", "check_seed", "check_bool", "check_instance", "check_shape"]

# The seed also seeds numpy's generator for the bootstrap, which takes 0 .. 2**32-1.
MAX_SEED = 2**32 - 1
# The most torch threads a run takes, or a dispatch table entry says it measured with.
MAX_THREADS = 4096

T = TypeVar("T")


def check_number(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    integer: bool = False,
    low_ok: bool = False,
    high_ok: bool = True,
    what: Optional[str] = None,
) -> Any:
    """`value` if it is a finite number (an int with `integer`) in the interval low..high.

    `low_ok`/`high_ok` say whether the ends belong to it; bool is never a number here,
    since True silently meaning 1 hides a misplaced argument.
    """
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= low if low_ok else value > low) and (value <= high if high_ok else value < high)
    if not ok:
        what = what or ("an integer" if integer else "a number")
        interval = f"{'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
        raise WideTesseraError(f"{name}={value!r}: give {what} in {interval}")
    return value


def check_seed(value: Any, name: str = "seed") -> int:
    return int(check_number(name, value, 0, MAX_SEED, integer=True, low_ok=True))


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise WideTesseraError(f"{name}={value!r}: give True or False")
    return value


def check_instance(name: str, value: Any, cls: Type[T]) -> Optional[T]:
    """`value` if it is None or a `cls`."""
    if value is not None and not isinstance(value, cls):
        raise WideTesseraError(f"{name}={value!r}: give a {cls.__name__} or None")
    return value


def check_shape(what: str, shape: Sequence[int], expected: Sequence[Union[int, str]]) -> None:
    """That `shape` is `expected`: an int is that size, a name any size, "..." any number of
    axes (once). A wide module's pack and from_modules call it, so that a wrong shape is this
    line, naming `what`, and not torch's "shape '[2, -1, 4]' is invalid" from deep in forward."""
    cut = list(expected).index("...") if "..." in expected else len(expected)
    head, tail = list(expected[:cut]), list(expected[cut + 1 :])
    if "..." in expected:
        fits = len(shape) >= len(head) + len(tail)
        pairs = [*zip(shape[: len(head)], head), *zip(shape[len(shape) - len(tail) :], tail)]
    else:
        fits, pairs = len(shape) == len(head), list(zip(shape, head))
    if not fits or any(isinstance(want, int) and size != want for size, want in pairs):
        wanted = ", ".join(str(e) for e in expected)
        raise WideTesseraError(f"{what} has shape [{', '.join(map(str, shape))}]; expected [{wanted}]")
