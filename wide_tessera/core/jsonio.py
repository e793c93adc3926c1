"""The one way files of ours are read and written as JSON, and the check that decoded JSON matches
a dataclass's field types before dataclasses-json builds objects from it.

dataclasses-json builds whatever it is given: a string where a number belongs, a list
where a dict belongs; the error surfaces later, far from the file, as an AttributeError
or a wrong number in a summary. Checking against the dataclasses' own annotations covers
every field, including ones added later, with no list of fields to keep up to date.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Type, TypeVar, Union, cast

from .errors import DamagedFile, WideTesseraError
from .files import not_a_regular_file, write_atomic

__all__ = ["check_json", "build", "read_json", "json_text", "write_json", "load_document"]

T = TypeVar("T")

_SCALARS = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def check_json(value: Any, hint: Any, where: str) -> None:
    """Raise a one-line WideTesseraError naming `where` unless `value` (decoded JSON) fits the type `hint`.

    Types this does not know (Any included) are left to the dataclasses' own checks.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return check_json(value, options[0], where)
        if all(o in _SCALARS for o in options):  # Union[str, int]: one of them
            ok = any(isinstance(value, _SCALARS[o]) and (o is bool or not isinstance(value, bool)) for o in options)
            return _expect(ok, value, " or ".join(f"a {o.__name__}" for o in options), where)
        return  # a wider union: left to the dataclasses
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        _check_fields(hint, value, where)
    elif origin is list:
        _expect(isinstance(value, list), value, "a list", where)
        for i, item in enumerate(value):
            check_json(item, args[0], f"{where}[{i}]")
    elif origin is dict:
        _expect(isinstance(value, dict), value, "an object", where)
        for key, item in value.items():
            check_json(item, args[1], f"{where}[{key!r}]")
    elif hint in _SCALARS:
        # bool is an int in Python, but true where a number belongs is a corrupt file
        ok = isinstance(value, _SCALARS[hint]) and (hint is bool or not isinstance(value, bool))
        _expect(ok, value, f"a {hint.__name__}", where)


def _check_fields(cls: type, value: Any, where: str) -> None:
    _expect(isinstance(value, dict), value, f"a {cls.__name__} object", where)
    for f in dataclasses.fields(cls):
        if f.name in value:
            check_json(value[f.name], _hints(cls)[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise WideTesseraError(f"{where}: missing field {f.name!r}")
    # Fields this version does not know are ignored: a newer writer may add some.


@lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _expect(ok: bool, value: Any, expected: str, where: str) -> None:
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise WideTesseraError(f"{where}: expected {expected}, got {shown}")


def build(raw: Any, cls: Type[T], where: str) -> T:
    """`cls` from decoded JSON, checked first (check_json); what dataclasses-json cannot decode,
    which it only warns about, is an error."""
    check_json(raw, cls, where)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return cast(T, cls.from_dict(raw))  # type: ignore[attr-defined]  # dataclass_json adds it


def read_json(path: Union[str, Path], label: str, what: str) -> Any:
    """The decoded JSON of a file of ours (a results file, a dispatch table, a collectives run),
    by the rule every file the tool reads or writes follows: numbers are finite. NaN, Infinity
    and numbers too large for a float (1e400, which Python reads as inf) are refused, as
    `json.dumps(allow_nan=False)` refuses to write them; a timing of inf would otherwise load
    and be compared. Only a regular file is read: a FIFO would wait for a writer, /dev/full never ends.
    One WideTesseraError, `label: ...`, for a file that is missing, unreadable or not JSON."""
    kind = not_a_regular_file(Path(path))
    if kind is not None:
        raise WideTesseraError(f"{label}: is {kind}, not {what.replace('wide_tessera ', '')}")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise WideTesseraError(f"{label}: cannot read ({e.strerror or e})") from None
    except ValueError as e:  # not UTF-8
        raise DamagedFile(f"{label}: not {what} ({e})") from None
    try:
        return json.loads(text, parse_constant=_not_finite, parse_float=_finite_float)
    except ValueError as e:
        raise DamagedFile(f"{label}: not {what} (not JSON: {e})") from None
    except RecursionError:
        raise DamagedFile(f"{label}: not {what} (nested too deeply)") from None


def _not_finite(name: str) -> float:
    raise ValueError(f"{name} is not a finite number; the files hold only finite numbers")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _not_finite(text)
    return value


def json_text(path: Union[str, Path], document: Any) -> str:
    """`document` as our files hold it (JSON, indented by one space), by the rule `write_json`
    keeps: a non-finite number is refused with one line naming the file, which keeps what it held."""
    try:
        return json.dumps(document, indent=1, allow_nan=False)
    except ValueError:
        raise WideTesseraError(
            f"{path}: not written: it would hold NaN or an infinity, which no file of ours holds; what it held is kept"
        ) from None


def write_json(path: Union[str, Path], document: Any, holds: Optional[str]) -> None:
    """Write `document`, which holds `holds` (what it may replace: files.results_target), as JSON
    (replaced atomically, see files.write_atomic; see json_text)."""
    write_atomic(path, json_text(path, document) + "\n", holds)


def load_document(
    path: Union[str, Path],
    cls: Type[T],
    fmt: str,
    version: int,
    label: str,
    what: str,
    check: Callable[[T], None] = lambda document: None,
) -> T:
    """The `cls` in a JSON file marked {"format": fmt, "version": version} (a dispatch table, a
    collectives run), after `check`; a missing, damaged or foreign file is one WideTesseraError,
    `label: ...` (see read_json)."""
    doc = read_json(path, label, what)
    try:
        if not isinstance(doc, dict) or doc.get("format") != fmt:
            raise WideTesseraError(f'no "format": "{fmt}"')
        if doc.get("version") != version:
            raise WideTesseraError(f"version {doc.get('version')!r}; this wide_tessera reads {version}")
        document = build(doc, cls, "document")
        check(document)
        return document
    except Exception as e:  # noqa: BLE001  a foreign or damaged file: one line
        detail = str(e) if isinstance(e, WideTesseraError) else f"{type(e).__name__}: {e}"
        raise DamagedFile(f"{label}: not {what} ({' '.join(detail.split())})") from None
