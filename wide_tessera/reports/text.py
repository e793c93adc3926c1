"""The human-readable summary of a result: one row per point, then the crossover per group."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..core.job import params_text
from ..core.roles import BASELINE, CONTROLS
from ..measurement.controls import legend
from ..measurement.roofline import roofline
from .advice import advice_table
from .answer import bound_lines, capture_text, crossover_text, decision_cell, interval_legend, result_n_text

if TYPE_CHECKING:  # only for annotations: the schema imports this module to render itself
    from ..results.schema import BenchmarkResult, PointResult

__all__ = [
    "format_summary",
    "format_table",
    "warning_lines",
    "warning_digest",
    "controls_run",
    "first_line",
    "measured_points",
    "no_speedup",
    "notes_digest",
    "ran_digest",
]

# The summary shows this many of the worst warnings; the rest are counted (`show FILE --warnings` lists all).
_DIGEST_WORST = 3


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])


def no_speedup(point: "PointResult", strategy: str) -> Optional[str]:
    """Why a strategy has no speedup at a point (ERROR, TIMEOUT, CRASH, SKIPPED, INCORRECT, '-'), or None."""
    if strategy in point.failures:
        return point.failures[strategy].kind.upper()
    check = point.checks.get(strategy)
    if check is not None and not check.correct:
        return "INCORRECT"
    return "-" if strategy not in point.speedup_ci else None


def _cell(point: "PointResult", strategy: str) -> str:
    why = no_speedup(point, strategy)
    if why is not None:
        return why
    check = point.checks.get(strategy)
    low, high = point.speedup_ci[strategy]
    mark = {"faster": "", "slower": "", "same": " n.s."}[point.verdicts[strategy]]
    loop = " loop" if check is not None and check.fallback else ""
    return f"{point.timings[strategy]:.4g} {point.speedups[strategy]:.2f}x [{low:.2f},{high:.2f}]{mark}{loop}"


def _baseline_cell(point: "PointResult") -> str:
    if "point" in point.failures:
        return point.failures["point"].kind.upper()
    return f"{point.timings['baseline']:.4g}"


def _per_callable_cell(values: Dict[str, Any], names: Sequence[str], text: Callable[[Any], str]) -> str:
    """One figure per callable, the baseline's first: 'baseline/strategy/...', '-' where it has none."""
    return "/".join(text(values[s]) if s in values else "-" for s in (BASELINE, *names))


def _roofline_line(result: "BenchmarkResult", point: "PointResult", names: Sequence[str]) -> str:
    """At one point: each timing's percentage of its roofline bound, and which ceiling binds."""
    dtype = str(point.params.get("dtype", "float32"))
    cells = []
    for s in (BASELINE, *names):
        if s in point.timings:
            r = roofline(point.work, point.timings[s], result.peaks, dtype)
            cells.append(f"{s} {r.percent_of_bound:.1f}% ({r.tflops:.3g} TFLOP/s, {r.gbps:.3g} GB/s)")
    bound = roofline(point.work, 1.0, result.peaks, dtype).bound
    return f"  N={point.n} {params_text(point.params)} [{bound}-bound]: " + "; ".join(cells)


ENERGY_LEGEND = (
    "mJ/call (W): energy per call from NVML's counter, the median of each callable's windows of its own "
    "(measurement.energy), and its mean power in watts"
)


# How the digest orders the worst cases: verdicts in doubt before noisy timings.
_SEVERITY = {"unstable": 100.0, "second look": 50.0}


def _warning_items(result: "BenchmarkResult") -> List[Tuple[str, float, str]]:
    """(kind, severity, line) for every warning; severity orders the digest's worst cases.

    Why a group's verdicts are in doubt (disturbed, unstable, unconverged near the margin)
    comes from its `problems`, which the analysis wrote; timings and flags from the points.
    """
    items = []
    for p in result.points:
        where = f"N={p.n} {params_text(p.params)}"
        for s, st in p.stats.items():
            if not st.converged:
                items.append(("not converged", st.median_ci_rel_width, f"{where} {s}: {'; '.join(st.warnings)}"))
            elif st.warnings:
                items.append(("high spread", st.cv, f"{where} {s}: {'; '.join(st.warnings)}"))
        items += [("second look", _SEVERITY["second look"], f"{where} {flag}") for flag in p.flags]
    for g in result.groups:
        for problem in g.problems:
            n, _, why = problem.partition(": ")
            kind = why.split(":")[0]
            items.append((kind, _SEVERITY.get(kind, 10.0), f"{n} {params_text(g.params)}: {why}"))
    return items


def failure_lines(result: "BenchmarkResult") -> List[str]:
    """One line per incorrect, failed, timed-out or crashed strategy or point, with the reason."""
    lines = []
    for p in result.points:
        where = f"N={p.n} {params_text(p.params)}"
        lines += [f"{where} {s}: incorrect: {c.error}" for s, c in p.checks.items() if not c.correct]
        lines += [f"{where} {s}: {f}" for s, f in p.failures.items() if f.kind != "skipped"]
    return lines


def skipped_lines(result: "BenchmarkResult") -> List[str]:
    """One line per strategy or point skipped, with the reason."""
    return [
        f"N={p.n} {params_text(p.params)}: {f.message}"
        for p in result.points
        for f in p.failures.values()
        if f.kind == "skipped"
    ]


def warning_lines(result: "BenchmarkResult") -> List[str]:
    """Every warning of a result, one line each."""
    return [line for _, _, line in _warning_items(result)]


def warning_digest(result: "BenchmarkResult") -> List[str]:
    """A few lines a person reads: counts by kind, then the worst cases."""
    items = _warning_items(result)
    if not items:
        return []
    counts = Counter(kind for kind, _, _ in items)
    worst = sorted(items, key=lambda item: -item[1])[:_DIGEST_WORST]
    more = f"; all {len(items)} with `wide_tessera show FILE --warnings`" if len(items) > len(worst) else ""
    return [
        "WARNINGS: " + ", ".join(f"{k} {c}" for k, c in counts.most_common()) + more,
        *(f"  {line}" for _, _, line in worst),
    ]


def controls_run(result: "BenchmarkResult") -> List[str]:
    """The controls some point of the result ran."""
    return [c for c in CONTROLS if any(c in p.checks or c in p.failures for p in result.points)]


def notes_digest(result: "BenchmarkResult") -> List[str]:
    """What was seen that could flip no decision (a busy machine, a disturbed point deciding
    nothing), counted by kind: a note, never a reason."""
    kinds: Dict[str, List[str]] = {}
    for g in result.groups:
        for note in g.notes:
            n, _, why = note.partition(": ")
            kinds.setdefault(why.split(":")[0].split(",")[0], []).append(n[2:])
    if not kinds:
        return []
    return [
        "NOTES (none could flip a decision): "
        + "; ".join(f"{k} at N={','.join(dict.fromkeys(ns))}" for k, ns in kinds.items())
    ]


def ran_digest(result: "BenchmarkResult") -> List[str]:
    """How each strategy that gives an account of itself ran the N models (surgery: the layers it
    swapped and those it left to vmap), each account once, with the N values it held at."""
    seen: Dict[Tuple[str, str], List[int]] = {}
    for p in result.points:
        for strategy, check in p.checks.items():
            if check.ran:
                seen.setdefault((strategy, check.ran), []).append(p.n)
    return [f"{s} ran: {ran} (N={','.join(map(str, dict.fromkeys(ns)))})" for (s, ran), ns in seen.items()]


def _skipped_lines(result: "BenchmarkResult") -> List[str]:
    """A skipped point, one line each; a skipped strategy, one line per reason with its count of
    points: a strategy this device cannot run is skipped at every point, and one line says so."""
    points = [
        f"  N={p.n} {params_text(p.params)}: {p.failures['point'].message}"
        for p in result.points
        if "point" in p.failures and p.failures["point"].kind == "skipped"
    ]
    strategies = Counter(
        f.message for p in result.points for s, f in p.failures.items() if s != "point" and f.kind == "skipped"
    )
    return points + [f"  {why}" + (f" ({k} points)" if k > 1 else "") for why, k in strategies.items()]


def _largest_n(result: "BenchmarkResult") -> List["PointResult"]:
    """Each group's point of the largest N."""
    largest = {}
    for p in result.points:
        key = params_text(p.params)
        if key not in largest or p.n > largest[key].n:
            largest[key] = p
    return list(largest.values())


def measured_points(result: "BenchmarkResult") -> List["PointResult"]:
    """The points whose baseline was timed: the only ones a verdict can come from."""
    return [p for p in result.points if p.timings]


def first_line(result: "BenchmarkResult") -> str:
    """The run's verdict on itself: INCOMPLETE first when it stopped early; NOTHING MEASURED when
    every point was skipped or failed (no verdict, not a win for the baseline); else RELIABLE or
    UNRELIABLE with the reasons."""
    incomplete = "" if result.complete else "INCOMPLETE, "
    if not measured_points(result):
        skipped = sum(p.failures["point"].kind == "skipped" for p in result.points)
        return (
            f"{incomplete}NOTHING MEASURED: of {len(result.points)} points, {skipped} skipped and "
            f"{len(result.points) - skipped} failed"
        )
    return incomplete + ("RELIABLE" if result.reliable else "UNRELIABLE: " + "; ".join(result.unreliable_reasons))


def _crossover_lines(result: "BenchmarkResult") -> List[str]:
    """Crossover per group and the headline; marked provisional when the run is incomplete."""
    if not measured_points(result):
        return ["crossover_n: none: nothing was measured, so nothing says whether fusing pays"]
    provisional = "" if result.complete else " (provisional: the run is incomplete)"
    crossed = sum(g.crossover_n is not None for g in result.groups)
    wins = sorted(result.strategy_wins.items(), key=lambda x: -x[1])
    confirmed = "unconfirmed: --confirm none" if result.confirm == "none" else "confirmed"
    return [
        f"crossover N per parameter group{provisional.replace(' (', ', ').rstrip(')')} (smallest N from which fusing "
        f"wins, {confirmed}, at every larger N):",
        *(f"  {params_text(g.params)}: {crossover_text(g)}" for g in result.groups),
        f"crossover_n: {result_n_text(result, result.crossover_n)}{provisional} "
        f"({crossed}/{len(result.groups)} groups cross) | "
        f"recommended_threshold: {result_n_text(result, result.recommended_threshold)} | best speedup: "
        + ("none significant" if result.best_speedup is None else f"{result.best_speedup:.2f}x"),
        "wins: " + ", ".join(f"{s} {k}" for s, k in wins),
    ]


def format_summary(result: "BenchmarkResult") -> str:
    shown = [*result.strategies, *controls_run(result)]
    captures = [g for g in result.groups if g.fuse_or_capture is not None]
    lines = [
        first_line(result),
        _run_line(result),
        _points_table(result, shown),
        *interval_legend(result),
        "n.s.: no significant difference from baseline; loop (in a cell): the strategy ran a per-model loop"
        + (
            f"; controls make the loop cheaper without fusing ({legend(controls_run(result))}) and never win"
            if len(shown) > len(result.strategies)
            else ""
        ),
        *([ENERGY_LEGEND] if result.measured_energy else []),
        *(["fuse, or just make the loop cheaper? (best strategy against the fastest control):"] if captures else []),
        *(f"  {params_text(g.params)}: at N={g.fuse_or_capture.n}: {capture_text(g)}" for g in captures),
        *_roofline_lines(result, shown),
        *_crossover_lines(result),
        *bound_lines(result),
        *notes_digest(result),
        *ran_digest(result),
        *warning_digest(result),
    ]
    if result.skipped:
        lines.append(f"SKIPPED ({len(result.skipped)}):")
        lines.extend(_skipped_lines(result))
    if result.failures:
        lines.append(f"FAILED ({len(result.failures)}):")
        lines.extend(f"  {f}" for f in result.failures)
    if not result.complete:
        lines.append(f"INCOMPLETE: the run stopped after {len(result.points)} points; --resume continues it")
    return "\n".join([*lines, *advice_lines(result)])


def _run_line(result: "BenchmarkResult") -> str:
    """Where and how the run measured: device, threads, timer, torch, compile mode, mode, duration."""
    env = result.environment
    return (
        f"== {result.op} (preset {result.preset}) on {env.device}: {env.device_name}, {env.threads} threads, "
        f"timer {result.timer}, torch {env.torch_version}, "
        + ("" if result.compile == "none" else f"torch.compile mode {result.compile} on every side, ")
        + f"mode {result.mode}, {result.duration_s:.1f} s"
    )


def _points_table(result: "BenchmarkResult", shown: List[str]) -> str:
    """One row a point: its parameters, the baseline, each strategy and control shown, the
    decision, memory peaks, launches and, where measured, energy."""
    axes: List[str] = list(result.points[0].params) if result.points else []
    energy = result.measured_energy
    header = [
        "N",
        *axes,
        "baseline ms",
        *(f"{s}{' (control)' if s in CONTROLS else ''} ms speedup [CI]" for s in shown),
        "decision",
        "peak MiB (baseline/" + "/".join(shown) + ")",
        "launches/call",
        *(["mJ/call (W)"] if energy else []),
    ]
    rows = [
        [
            str(p.n),
            *(str(p.params[a]) for a in axes),
            _baseline_cell(p),
            *(_cell(p, s) for s in shown),
            decision_cell(p),
            _per_callable_cell(p.peak_memory_bytes, shown, lambda b: f"{b / 2**20:.3g}"),
            _per_callable_cell(p.launches, shown, lambda k: f"{k:g}"),
            *(
                [_per_callable_cell(p.energy, shown, lambda e: f"{e.mj_per_call:.3g} ({e.watts:.0f})")]
                if energy
                else []
            ),
        ]
        for p in result.points
    ]
    return format_table(header, rows)


def _roofline_lines(result: "BenchmarkResult", shown: List[str]) -> List[str]:
    """Each measured point at a group's largest N against the machine's measured peaks; none
    without peaks."""
    peaks = result.peaks
    if peaks is None:
        return []
    measured = [p for p in _largest_n(result) if p.work is not None and p.timings]
    roof = [p for p in measured if p.params.get("dtype", "float32") in peaks.tflops]
    if not roof:
        return []
    head = (
        f"roofline at the largest N (peaks measured on {peaks.device_name}: "
        + ", ".join(f"{d} {t:.3g} TFLOP/s" for d, t in peaks.tflops.items())
        + f", copy {peaks.copy_gbps:.4g} GB/s):"
    )
    return [head, *(_roofline_line(result, p, shown) for p in roof)]


def advice_lines(result: "BenchmarkResult") -> List[str]:
    """The op's advice table (reports.advice), as the text reports end with it; none without one."""
    advice = advice_table(result)
    if advice is None:
        return []
    title, header, rows = advice
    return [title, format_table(header, rows)]
