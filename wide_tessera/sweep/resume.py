"""What `--resume` may continue, and in what order a continued result holds its points.

A resumed file keeps every result and every point it holds; the run adds only what is
missing. Points measured under other settings would be mixed with the new ones under
one label, so a file measured differently is refused instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.errors import WideTesseraError
from ..core.job import group_key
from ..core.environment import Environment
from ..core.job import SweepParams
from ..core.job import point_key, point_keys
from ..results.schema import BenchmarkResult, PointResult
from ..measurement.timing import TimingConfig

__all__ = ["check_resumable", "point_order", "points_left"]


def _measured_with(
    preset: str, seed: int, timing: TimingConfig, env: Environment, compile_mode: str, mode: str, energy: bool
) -> List[Tuple[str, Any]]:
    """Everything that changes what a measurement means or holds, by name."""
    return [
        ("preset", preset),
        ("mode", mode),
        ("compile mode", compile_mode),
        ("energy", energy),
        ("device", env.device),
        ("seed", seed),
        ("threads", env.threads),
        ("timing", timing),
        ("device name", env.device_name),
        ("torch", env.torch_version),
    ]


def _show(name: str, value: Any, other: Any) -> str:
    if isinstance(value, TimingConfig):  # only the settings that differ, not all seven
        fields = [f.name for f in dataclasses.fields(value) if getattr(value, f.name) != getattr(other, f.name)]
        return "timing " + ", ".join(f"{f}={getattr(value, f)}" for f in fields)
    if name == "energy":
        return "--energy" if value else "no --energy"
    return f"{name} {value}"


def check_resumable(
    previous: BenchmarkResult,
    path: str,
    preset: str,
    seed: int,
    timing: TimingConfig,
    env: Environment,
    compile_mode: str = "none",
    mode: str = "inference",
    energy: bool = False,
) -> None:
    """Raise WideTesseraError naming the first setting of `previous` that differs from this run's.

    Energy counts as a setting: resumed the other way, half a table would have an energy
    column and half none. A file with no points yet cannot say, so it never conflicts.
    """
    had_energy = previous.measured_energy if previous.points else energy
    was = _measured_with(
        previous.preset, previous.seed, previous.timing, previous.environment, previous.compile, previous.mode, had_energy
    )
    now = _measured_with(preset, seed, timing, env, compile_mode, mode, energy)
    for (name, old), (_, new) in zip(was, now):
        if old != new:
            raise WideTesseraError(
                f"--resume: {path} has {previous.op} measured with {_show(name, old, new)}; "
                f"this run asks for {_show(name, new, old)}"
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
