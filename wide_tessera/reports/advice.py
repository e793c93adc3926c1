"""The advice table an op registered (core.advice), computed from a result's points.

Per row and column: the choice whose time is smallest against the first reference's over the
cell's points (the geometric mean of the ratios of medians, so a cell of decode sizes and one of
prefill sizes weigh each point alike), with its speedup over each reference. A cell where a
reference was not timed (skipped, or incorrect) shows '-' for it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from ..core.advice import Advice, advice_of

if TYPE_CHECKING:
    from ..results.schema import BenchmarkResult, PointResult

__all__ = ["advice_table"]


def _geomean_ratio(points: Sequence["PointResult"], reference: str, choice: str) -> Optional[float]:
    if not all(reference in p.timings and choice in p.timings for p in points):
        return None
    ratios = [p.timings[reference] / p.timings[choice] for p in points]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def _cell(points: Sequence["PointResult"], advice: Advice) -> str:
    timed = [c for c in advice.choices if all(c in p.timings for p in points)]
    first = advice.references[0]
    if not timed or not points:
        return "-"
    best = max(timed, key=lambda c: _geomean_ratio(points, first, c) or 0.0)
    speeds = []
    for reference in advice.references:
        r = _geomean_ratio(points, reference, best)
        speeds.append(f"{'-' if r is None else f'{r:.2f}x'} {reference}")
    return f"{advice.label(best)} ({', '.join(speeds)})"


def advice_table(result: "BenchmarkResult") -> Optional[Tuple[str, List[str], List[List[str]]]]:
    """(title, header, rows) of the op's advice, or None where it registered none or nothing was timed."""
    advice = advice_of(result.op)
    points = [p for p in result.points if p.timings]
    if advice is None or not points:
        return None
    cells: Dict[Tuple[str, ...], Dict[str, List["PointResult"]]] = {}
    for p in points:
        column = advice.column(p.params)
        if column is not None:
            row = tuple(str(p.n if axis == "n" else p.params.get(axis)) for axis in advice.rows)
            cells.setdefault(row, {}).setdefault(column, []).append(p)
    header = [*("N" if a == "n" else a for a in advice.rows), *advice.columns]
    rows = [[*row, *(_cell(by.get(c, []), advice) for c in advice.columns)] for row, by in cells.items()]
    return advice.title, header, rows
