"""What an op advises a person to choose, per group of its points, at the end of its reports.

An op registers an `Advice` under its name (ops import core); `reports.advice` renders it from a
result's points (reports import core). Neither imports the other, and a result without advice
(every op but those that register one) reports as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["Advice", "register_advice", "advice_of"]


@dataclass(frozen=True)
class Advice:
    """title: the table's heading. rows: the axes ('n' for N) that name a row. column: a point's
    parameters -> the column it falls in (None: in none). choices: the strategies a person can
    choose (others, the controls and the baseline, are never advised). references: the choices
    the advised one is compared with, each a column of speedups. label: a choice's name as the
    person would type it."""

    title: str
    rows: Tuple[str, ...]
    column: Callable[[Dict[str, Any]], Optional[str]]
    columns: Tuple[str, ...]
    choices: Tuple[str, ...]
    references: Tuple[str, ...]
    label: Callable[[str], str]


_ADVICE: Dict[str, Advice] = {}


def register_advice(op: str, advice: Advice) -> None:
    _ADVICE[op] = advice


def advice_of(op: str) -> Optional[Advice]:
    return _ADVICE.get(op)
