"""The human-readable summary of a result: one row per point, then the crossover per group."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

from .analysis import MIN_EFFECT
from .schema import params_text

if TYPE_CHECKING:
    from .schema import BenchmarkResult, PointResult

__all__ = ["format_summary", "format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])


def _cell(point: "PointResult", strategy: str) -> str:
    if strategy in point.failures:
        return point.failures[strategy].kind.upper()  # ERROR, TIMEOUT, CRASH
    check = point.checks.get(strategy)
    if check is not None and not check.correct:
        return "INCORRECT"
    if strategy not in point.speedup_ci:
        return "-"
    low, high = point.speedup_ci[strategy]
    mark = {"faster": "", "slower": "", "same": " n.s."}[point.verdicts[strategy]]
    return f"{point.timings[strategy]:.4g} {point.speedups[strategy]:.2f}x [{low:.2f},{high:.2f}]{mark}"


def _baseline_cell(point: "PointResult") -> str:
    if "point" in point.failures:
        return point.failures["point"].kind.upper()
    return f"{point.timings['baseline']:.4g}"


def _memory_cell(point: "PointResult", strategies: Sequence[str]) -> str:
    peaks = point.peak_memory_bytes
    return "/".join(f"{peaks[s] / 2**20:.3g}" if s in peaks else "-" for s in ("baseline", *strategies))


def _n_or_never(n: Optional[int]) -> str:
    return "never" if n is None else str(n)


def format_summary(result: "BenchmarkResult") -> str:
    env = result.environment
    axes: List[str] = list(result.points[0].params) if result.points else []
    header = [
        "N",
        *axes,
        "baseline ms",
        *(f"{s} ms speedup [95% CI]" for s in result.strategies),
        "winner",
        "peak MiB (baseline/" + "/".join(result.strategies) + ")",
    ]
    rows = [
        [
            str(p.n),
            *(str(p.params[a]) for a in axes),
            _baseline_cell(p),
            *(_cell(p, s) for s in result.strategies),
            "-" if "point" in p.failures else p.winner,
            _memory_cell(p, result.strategies),
        ]
        for p in result.points
    ]
    crossed = sum(g.crossover_n is not None for g in result.groups)
    lines = [
        f"== {result.op} (preset {result.preset}) on {env.device}: {env.device_name}, {env.threads} threads, "
        f"timer {result.timer}, torch {env.torch_version}, {result.duration_s:.1f} s",
        format_table(header, rows),
        f"n.s.: no significant difference from baseline; a win needs the whole CI above {1 + MIN_EFFECT:.2f}",
        "crossover N per parameter group (smallest N from which fusing wins at every larger N):",
        *(f"  {params_text(g.params)}: {_n_or_never(g.crossover_n)}" for g in result.groups),
        f"crossover_n: {_n_or_never(result.crossover_n)} ({crossed}/{len(result.groups)} groups cross) | "
        f"recommended_threshold: {_n_or_never(result.recommended_threshold)} | best speedup: "
        + ("none correct" if result.best_speedup is None else f"{result.best_speedup:.2f}x"),
        "wins: " + ", ".join(f"{s} {k}" for s, k in sorted(result.strategy_wins.items(), key=lambda x: -x[1])),
    ]
    if result.warnings:
        lines.append(f"WARNINGS ({len(result.warnings)}):")
        lines.extend(f"  {w}" for w in result.warnings)
    if result.skipped:
        lines.append(f"SKIPPED ({len(result.skipped)}):")
        lines.extend(f"  {f}" for f in result.skipped)
    if result.failures:
        lines.append(f"FAILED ({len(result.failures)}):")
        lines.extend(f"  {f}" for f in result.failures)
    if not result.complete:
        lines.append(f"INCOMPLETE: the run stopped after {len(result.points)} points; --resume continues it")
    return "\n".join(lines)
