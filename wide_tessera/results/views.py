"""The ways a result is shown (its summary, warnings, tidy rows), looked up by name.

A result offers `result.summary()` and the like, but the data must not import what draws it:
`wide_tessera.reports` registers its renderers here when it is imported, and the first
use imports it where nothing has yet (a program that imported only `wide_tessera.results`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict

__all__ = ["register_view", "view"]

_VIEWS: Dict[str, Callable[..., Any]] = {}


def register_view(name: str, render: Callable[..., Any]) -> None:
    _VIEWS[name] = render


def view(name: str) -> Callable[..., Any]:
    if name not in _VIEWS:
        importlib.import_module("wide_tessera.reports")  # registers every view
    return _VIEWS[name]
