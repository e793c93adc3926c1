"""`wide_tessera list`: every op with its strategies, presets and sweep axes, and what a run here measures."""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Tuple

import click

from ..api import preset_sweep
from ..core.capabilities import unmet_need
from ..core.errors import WideTesseraError
from ..core.job import DTYPES
from ..measurement.settings import resolve_device
from ..ops.registry import REGISTRY, import_ops, op_names, outside_strategies
from ..reports.text import format_table
from .options import IMPORT, usage_errors

__all__ = ["list_ops"]


@click.command("list")
@IMPORT
@click.option(
    "--device",
    default=None,
    help="Count the points a run will have on this device  [default: cuda if available, else cpu]",
)
def list_ops(imports: Tuple[str, ...], device: Optional[str]) -> None:
    """Every op with its strategies, presets and sweep axes, and what a run on this device will measure."""
    with usage_errors():
        import_ops(imports)
        names = op_names()
        device = resolve_device(device)
    for name in names:
        cls = REGISTRY[name]
        aliases = [k for k, v in REGISTRY.items() if v is cls and k != name]
        click.echo(f"{name}" + (f" (alias: {', '.join(aliases)})" if aliases else "") + f"  [{cls.__name__}]")
        outside = [f"{s} (outside)" for s in outside_strategies(cls)]
        click.echo(f"  strategies: baseline, {', '.join([*cls.BENCHMARK_STRATEGIES, *outside])}")
        rows, skipped = [], {}
        for preset, sweep in cls.BENCHMARK_SWEEPS.items():
            here, why = _points_here(name, preset, device)
            skipped.update(why)
            axes = " ".join(f"{k}={','.join(map(str, v))}" for k, v in sweep.axes.items())
            rows.append([preset, ",".join(map(str, sweep.n_values)), str(sweep.n_points()), str(here), axes])
        table = format_table(["preset", "n_values", "points", f"on {device}", "axes"], rows)
        click.echo("  " + table.replace("\n", "\n  "))
        for strategy, reason in skipped.items():
            click.echo(f"  on {device}, {strategy} is skipped: {reason}")
        asked = [s for s, needs in cls.strategy_needs().items() if needs.probe_runs_op and s not in skipped]
        if asked:
            click.echo(f"  {', '.join(asked)}: whether each runs here, the run asks at each point (by building the op)")


def _points_here(op: str, preset: str, device: str) -> Tuple[int, Dict[str, str]]:
    """The points a run of `preset` measures on `device` (presets leave out dtypes the device lacks
    or emulates), and the strategies skipped at every one of them, with the reason (a probe that
    runs the op is left to the run: Needs.probe_runs_op)."""
    try:
        sweep = preset_sweep(op, preset, device)
    except WideTesseraError:  # no dtype of the preset runs here
        return 0, {}
    cls = REGISTRY[op]
    points = sweep.points()
    needs = {s: replace(n, probe=None) if n.probe_runs_op else n for s, n in cls.strategy_needs().items()}
    skipped = {}
    for strategy in [*cls.BENCHMARK_STRATEGIES, *outside_strategies(cls)]:
        reasons = [
            unmet_need(needs.get(strategy), device, DTYPES[params.get("dtype", "float32")], params)
            for _, params in points
        ]
        if points and all(reasons):
            skipped[strategy] = reasons[0]
    return len(points), skipped
