"""What `--resume` may continue, and in what order a continued result holds its points.

A resumed file keeps every result and every point it holds; the run adds only what is
missing. Points measured under other settings would be mixed with the new ones under
one label, so a file measured differently is refused instead.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from ..core.environment import Environment
from ..core.errors import WideTesseraError
from ..core.job import SweepParams, group_key, point_key, point_keys
from ..measurement.settings import RunSettings
from ..results.alike import measured_with
from ..results.schema import BenchmarkResult, PointResult

__all__ = ["check_resumable", "point_order", "points_left"]


def check_resumable(previous: BenchmarkResult, path: str, settings: RunSettings, env: Environment) -> None:
    """Raise WideTesseraError naming the first setting of `previous` that differs from this run's."""
    now = measured_with(settings, env)
    for (name, old), (_, new) in zip(measured_with(previous.settings, previous.environment), now):
        if old != new:
            raise WideTesseraError(
                f"--resume: {path} has {previous.op} measured with {RunSettings.describe(name, old, new)}; "
                f"this run asks for {RunSettings.describe(name, new, old)}"
            )


def point_order(sweep: SweepParams, earlier: Sequence[PointResult]) -> Dict[str, int]:
    """Rank, by point key, of every point a continued result holds: the earlier ones and the sweep's.

    Parameter groups come in the order first seen, the earlier points' first, so a file
    keeps its order and new groups follow; within a group N ascends, so N values added
    by a later run fall into place.
    """
    groups: Dict[str, int] = {}
    rank: Dict[str, Tuple[int, int]] = {}
    for n, params in [*((p.n, p.params) for p in earlier), *sweep.points()]:
        group = groups.setdefault(group_key(params), len(groups))
        rank[point_key(n, params)] = (group, n)
    return {key: i for i, key in enumerate(sorted(rank, key=rank.__getitem__))}


def points_left(sweep: SweepParams, previous: Optional[BenchmarkResult]) -> int:
    """How many of the sweep's points a run continuing `previous` still measures (before confirmation)."""
    done = point_keys(previous.points) if previous else set()
    return sum(point_key(n, params) not in done for n, params in sweep.points())
