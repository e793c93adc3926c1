"""The one error type for bad user input, so the CLI can turn it into a clean exit 2."""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["WideTesseraError", "MissingDependency", "NotApplicable", "unknown", "one_line"]


class WideTesseraError(ValueError):
    """A value the user gave is wrong; the message names it and what would be valid."""


class MissingDependency(WideTesseraError):
    """An op needs an optional package that is not installed: asked for by name, an error; in a run of
    every op (`--all`), a skip with this message."""


class NotApplicable(WideTesseraError):
    """A strategy cannot apply to these models (surgery of a model it cannot capture): found when
    its wide module is built or first called, before any timing, and the runner skips it with
    this reason instead of failing it."""


def one_line(error: BaseException) -> str:
    """'TypeError: what it said', on one line, for an error raised by someone else's code: a
    model's multi-line message is folded, and an exception whose str() itself raises still
    gets its type named."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001  its __str__ is broken: the type is all there is
        text = "(its message could not be read)"
    text = " ".join(text.split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def unknown(kind: str, value: object, valid: Iterable[str]) -> WideTesseraError:
    """An error for a name that is not one of `valid`, suggesting the closest one."""
    valid = list(valid)
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return WideTesseraError(f"unknown {kind} {value!r}{hint} (valid: {', '.join(valid)})")
