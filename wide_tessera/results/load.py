"""Reading results files back: every field checked (types, then what must hold between them).

A damaged or foreign file gives one line naming the file and the first problem, never a
traceback and never a result that would show a wrong number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Union

from ..core.errors import DamagedFile, WideTesseraError
from ..core.jsonio import build, check_json, read_json
from .invariants import check_result
from .schema import READABLE_VERSIONS, BenchmarkResult

__all__ = ["load_results"]


def load_results(path: Union[str, Path]) -> List[BenchmarkResult]:
    """Every result in a file written by `save_results`, `result.save` or `wide_tessera benchmark -o`."""
    if not isinstance(path, (str, Path)):
        raise WideTesseraError(f"load_results: path={path!r}: give the path of a results file (a str or Path)")
    doc = read_json(path, str(path), "a wide_tessera results file")
    try:
        if not isinstance(doc, dict) or "schema_version" not in doc:
            raise WideTesseraError("no schema_version")
        version = doc["schema_version"]
        if version not in READABLE_VERSIONS:
            raise WideTesseraError(
                f"schema version {version!r}; this wide_tessera reads {', '.join(map(str, READABLE_VERSIONS))}"
            )
        check_json(doc.get("results"), List[Dict[str, Any]], "results")
        results = []
        for i, raw in enumerate(doc["results"]):
            if version < 7:
                raw = _with_settings(raw)
            raw = _before_regret(raw)
            result = build(raw, BenchmarkResult, f"results[{i}]")
            check_result(result, f"results[{i}]")
            results.append(result)
        return results
    except Exception as e:  # noqa: BLE001  RecursionError from deep nesting included: bad file, one line
        detail = str(e) if isinstance(e, WideTesseraError) else f"{type(e).__name__}: {e}"
        raise DamagedFile(f"{path}: not a wide_tessera results file ({' '.join(detail.split())})") from None


def _before_regret(raw: Any) -> Any:
    """A result whose settings hold no `regret` was decided by the rule before regret bounds, with
    its marginal zone: regret None, not the default a setting left out would take today."""
    settings = raw.get("settings") if isinstance(raw, dict) else None
    if not isinstance(settings, dict) or "regret" in settings:
        return raw
    return {**raw, "settings": {**settings, "regret": None}}


# Schema 3 to 6 held these settings as fields of the result; 7 holds them in `settings`.
_OLD_SETTINGS = ("preset", "timing", "seed", "confirm", "compile", "mode")


def _with_settings(raw: Dict[str, Any]) -> Dict[str, Any]:
    """A result of schema 3 to 6 as schema 7 holds it: its settings in one object. The energy
    setting was not recorded: a run asked for energy is one whose points hold some."""
    settings = {name: raw[name] for name in _OLD_SETTINGS if name in raw}
    points = raw.get("points")
    settings["energy"] = isinstance(points, list) and any(isinstance(p, dict) and p.get("energy") for p in points)
    environment = raw.get("environment")
    if isinstance(environment, dict) and isinstance(environment.get("device"), str):
        settings["device"] = environment["device"]
    return {**{k: v for k, v in raw.items() if k not in _OLD_SETTINGS}, "settings": settings}
