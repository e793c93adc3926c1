"""The one error type for bad user input, so the CLI can turn it into a clean exit 2."""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["WideTesseraError", "unknown"]


class WideTesseraError(ValueError):
    """A value the user gave is wrong; the message names it and what would be valid."""


def unknown(kind: str, value: object, valid: Iterable[str]) -> WideTesseraError:
    """An error for a name that is not one of `valid`, suggesting the closest one."""
    valid = list(valid)
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return WideTesseraError(f"unknown {kind} {value!r}{hint} (valid: {', '.join(valid)})")
