"""Pictures of a result: per op and parameter group, speedup, time and memory against N.

matplotlib is an optional extra (`pip install 'wide_tessera[plot]'`). Figures are drawn
with `matplotlib.figure.Figure`, not pyplot: no global state, no display needed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Sequence

from ..core.errors import WideTesseraError
from ..core.files import PLOT, make_folder, results_target
from ..core.job import params_text
from ..core.roles import BASELINE, CONTROLS
from ..core.stats import MIN_EFFECT
from .answer import crossover_text, level_of_result, level_text
from .text import controls_run, first_line

if TYPE_CHECKING:
    from ..results.schema import BenchmarkResult, GroupResult, PointResult

__all__ = ["plot_result", "group_figures", "FORMATS", "figure_class", "log_axis", "save_figure"]

FORMATS = ("png", "svg")


def figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise WideTesseraError("plots need matplotlib: pip install 'wide_tessera[plot]'") from None
    return Figure


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def _group_points(result: "BenchmarkResult", group: "GroupResult") -> List["PointResult"]:
    return sorted((p for p in result.points if p.params == group.params and p.timings), key=lambda p: p.n)


def _styles(names: Sequence[str]) -> Dict[str, dict]:
    """One look per callable, the same in every panel: the baseline black, thick and underneath (a
    strategy with the baseline's memory would otherwise hide it), controls dashed (they make the loop
    cheaper without fusing and never win)."""
    styles = {
        BASELINE: {"color": "black", "linewidth": 3.5, "alpha": 0.35, "zorder": 1, "marker": "s", "markersize": 6}
    }
    for i, s in enumerate(names):
        styles[s] = {
            "color": f"C{i}",
            "linestyle": "--" if s in CONTROLS else "-",
            "marker": "o",
            "markersize": 4,
            "zorder": 2,
        }
    return styles


def log_axis(axis) -> None:
    """A log axis labelled 1, 2, 5, 10, ... in plain numbers, not 10^-1 alone."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(NullFormatter())


def _draw_group(result: "BenchmarkResult", group: "GroupResult", points: Sequence["PointResult"]):
    Figure = figure_class()
    fig = Figure(figsize=(12, 8.5), layout="constrained")
    (speed, time), (memory, tradeoff) = fig.subplots(2, 2)
    names = [s for s in [*result.strategies, *controls_run(result)] if any(s in p.speedups for p in points)]
    ns = [p.n for p in points]
    style = _styles(names)
    _draw_speedups(speed, result, group, points, names, style)
    _draw_times(time, points, names, style)
    _draw_memory(memory, result, points, names, style)
    _draw_tradeoff(tradeoff, points, names, style)
    for ax in (speed, time, memory):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("N (copies of the op)")
    for ax in (speed, time, memory, tradeoff):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    status = first_line(result).split(":")[0]
    fig.suptitle(
        f"{result.op}: {params_text(group.params)}\n{result.environment.device_name} ({result.environment.device}), "
        f"preset {result.preset}, {status}",
        fontsize=11,
    )
    return fig


def _draw_speedups(
    speed: Any,
    result: "BenchmarkResult",
    group: "GroupResult",
    points: Sequence["PointResult"],
    names: Sequence[str],
    style: Dict[str, dict],
) -> None:
    """Each callable's speedup against N with its interval as a band, the significance margin
    dotted, the crossover dash-dotted; points without a verdict hollow."""
    for s in names:
        ps = [p for p in points if s in p.speedups]
        x = [p.n for p in ps]
        speed.plot(x, [p.speedups[s] for p in ps], label=s, **style[s])
        speed.fill_between(
            x, [p.speedup_ci[s][0] for p in ps], [p.speedup_ci[s][1] for p in ps], color=style[s]["color"], alpha=0.18
        )
        bad = [p for p in ps if p.unstable or p.disturbed]  # no verdict there: hollow markers
        speed.plot([p.n for p in bad], [p.speedups[s] for p in bad], "o", mfc="white", mec=style[s]["color"], ms=8)
    speed.axhline(1.0, color="black", linewidth=1)
    for margin in (1 + MIN_EFFECT, 1 / (1 + MIN_EFFECT)):
        speed.axhline(margin, color="grey", linewidth=0.8, linestyle=":")
    if group.crossover_n is not None:
        speed.axvline(
            group.crossover_n, color="black", linewidth=1.2, linestyle="-.", label=f"crossover N={group.crossover_n}"
        )
    hollow = "; hollow: no verdict (disturbed or unstable)" if any(p.unstable or p.disturbed for p in points) else ""
    level = level_of_result(result) or 0.95  # the decision rule's per-look level; 95% in older files
    speed.set_title(
        f"speedup over N separate calls: {crossover_text(group)}\n"
        f"(band: {level_text(level)} CI; dotted: ±5% significance margin{hollow})",
        fontsize=9,
    )
    speed.set_ylabel("speedup (x)")


def _draw_times(time: Any, points: Sequence["PointResult"], names: Sequence[str], style: Dict[str, dict]) -> None:
    """Each callable's median time per call against N, with its interval."""
    for s in [BASELINE, *names]:
        ps = [p for p in points if s in p.stats]
        lows = [p.timings[s] - p.stats[s].median_ci_ms[0] for p in ps]
        highs = [p.stats[s].median_ci_ms[1] - p.timings[s] for p in ps]
        time.errorbar([p.n for p in ps], [p.timings[s] for p in ps], yerr=[lows, highs], label=s, capsize=2, **style[s])
    time.set_yscale("log")
    log_axis(time.yaxis)
    time.set_title("median time per call of all N models (95% CI)", fontsize=9)
    time.set_ylabel("ms")


def _draw_memory(
    memory: Any,
    result: "BenchmarkResult",
    points: Sequence["PointResult"],
    names: Sequence[str],
    style: Dict[str, dict],
) -> None:
    """Each callable's peak memory against N."""
    for s in [BASELINE, *names]:
        ps = [p for p in points if s in p.peak_memory_bytes]
        memory.plot([p.n for p in ps], [p.peak_memory_bytes[s] / 2**20 for p in ps], label=s, **style[s])
    memory.set_yscale("log")
    log_axis(memory.yaxis)
    memory.set_title(f"peak memory above the inputs ({result.memory_method or 'measured'})", fontsize=9)
    memory.set_ylabel("MiB")


def _draw_tradeoff(
    tradeoff: Any, points: Sequence["PointResult"], names: Sequence[str], style: Dict[str, dict]
) -> None:
    """Each strategy's speedup against its memory, both relative to the N separate calls', each point labelled by N."""
    for s in names:
        ps = [p for p in points if s in p.speedups and s in p.peak_memory_bytes and BASELINE in p.peak_memory_bytes]
        x = [p.peak_memory_bytes[s] / max(p.peak_memory_bytes[BASELINE], 1) for p in ps]
        y = [p.speedups[s] for p in ps]
        tradeoff.plot(x, y, label=s, **style[s])
        for p, xi, yi in zip(ps, x, y):
            tradeoff.annotate(f"N={p.n}", (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    tradeoff.axhline(1.0, color="black", linewidth=1)
    tradeoff.axvline(1.0, color="grey", linewidth=0.6, linestyle=":")
    tradeoff.set_xscale("log")
    log_axis(tradeoff.xaxis)
    tradeoff.set_title("speed against memory, both relative to the N separate calls", fontsize=9)
    tradeoff.set_xlabel("peak memory / baseline's (x)")
    tradeoff.set_ylabel("speedup (x)")


def save_figure(fig, directory: Path, stem: str, formats: Sequence[str]) -> List[Path]:
    """`fig` as DIRECTORY/STEM.FMT for each format; every path is checked before any is written
    (files.results_target: a folder in the way, or a picture not ours, is refused)."""
    make_folder(directory, "plots folder")
    paths = [directory / f"{_slug(stem)}.{fmt}" for fmt in formats]
    for path in paths:
        results_target(path, PLOT)
    for path in paths:
        fig.savefig(path, dpi=110, metadata={"Title": f"{PLOT[2:]}: {stem}"})  # how results_target knows it as ours
    return paths


def group_figures(result: "BenchmarkResult") -> List[Any]:
    """One figure per parameter group with a measured point (matplotlib Figures, not saved)."""
    figures = []
    for group in result.groups:
        points = _group_points(result, group)
        if points:
            figures.append(_draw_group(result, group, points))
    return figures


def plot_result(result: "BenchmarkResult", directory: Path, formats: Sequence[str] = FORMATS) -> List[Path]:
    """One figure per parameter group with a measured point, in every format; the paths written."""
    written = []
    for group in result.groups:
        points = _group_points(result, group)
        if points:
            written += save_figure(
                _draw_group(result, group, points), Path(directory), f"{result.op}_{params_text(group.params)}", formats
            )
    return written
