"""What a run prints as it goes: each op's answer in a table that fits a terminal, and, after a
run of several ops, one closing table with the answer per op and group. `wide_tessera show`
prints the full summary (reports.text): every timing, memory, launches and energy."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

from ..core.job import params_text
from ..core.roles import CONTROLS
from .answer import bound_lines, capture_text, crossover_text, decision_cell, interval_legend, result_n_text
from .text import (
    advice_lines,
    controls_run,
    first_line,
    format_table,
    measured_points,
    no_speedup,
    notes_digest,
    ran_digest,
)

if TYPE_CHECKING:
    from ..results.schema import BenchmarkResult, GroupResult, PointResult

__all__ = ["brief_summary", "closing_table", "headline", "answer_table"]


def _varying(params: Sequence[Dict[str, Any]]) -> List[str]:
    """The axes whose value differs between points: the others go to the header line once."""
    names = list(params[0]) if params else []
    return [a for a in names if len({repr(p.get(a)) for p in params}) > 1]


def _speedup(point: "PointResult", strategy: str) -> str:
    why = no_speedup(point, strategy)
    if why is not None:
        return why
    lo, hi = point.speedup_ci[strategy]
    return f"{point.speedups[strategy]:.2f}x [{lo:.2f},{hi:.2f}]"


def headline(result: "BenchmarkResult") -> str:
    """Where the op ran, how, how long, and its answer in a few words."""
    env = result.environment
    threads = "1 thread timed by its CPU clock" if result.timer == "cpu_thread_time" else f"{env.threads} threads"
    return (
        f"== {result.op} (preset {result.preset}) on {env.device}: {env.device_name}, {threads}, "
        f"torch {env.torch_version}, {result.mode}{'' if result.compile == 'none' else ', compile ' + result.compile}, "
        f"{result.duration_s:.1f} s: {first_line(result)}"
    )


def answer_table(result: "BenchmarkResult", axes: Sequence[str]) -> Tuple[List[str], List[List[str]]]:
    """The header and one row per point: N, the point's value of each of `axes`, the baseline's
    time, every timed strategy's and control's speedup with its interval (a control's name
    marked *), the decision. The terminal's table and the notebook's are this one."""
    points = result.points
    # a strategy skipped at every point (a Triton kernel on a CPU) is a line under the table, not a column
    shown = [
        s for s in [*result.strategies, *controls_run(result)]
        if any(s in p.checks or (s in p.failures and p.failures[s].kind != "skipped") for p in points)
    ]  # fmt: skip
    header = ["N", *axes, "baseline ms", *(f"{s}{'*' if s in CONTROLS else ''}" for s in shown), "decision"]
    rows = [
        [
            str(p.n),
            *(str(p.params[a]) for a in axes),
            p.failures["point"].kind.upper() if "point" in p.failures else f"{p.timings['baseline']:.4g}",
            *(_speedup(p, s) for s in shown),
            decision_cell(p, confirmed_mark=False),
        ]
        for p in points
    ]
    return header, rows


def brief_summary(result: "BenchmarkResult") -> str:
    """One op's answer: a line on where it ran and whether it is reliable, the axes every point
    shares, then per point the baseline's time, every timed strategy's and control's speedup and
    the decision; the crossover and fuse-or-capture per group; notes, skips and failures."""
    points = result.points
    axes = _varying([p.params for p in points])
    fixed = {a: v for a, v in (points[0].params.items() if points else []) if a not in axes}
    header, rows = answer_table(result, axes)
    confirmed = sum(p.confirmation is not None for p in points)
    lines = [
        headline(result),
        *([params_text(fixed)] if fixed else []),
        format_table(header, rows),
        *interval_legend(result)[:1],
        *(
            ["*: a control, the loop made cheaper without fusing: it never wins"]
            if any(name.endswith("*") for name in header)
            else []
        ),
    ]
    if measured_points(result):
        label = lambda g: params_text({a: g.params[a] for a in axes if a in g.params}) or "all"  # noqa: E731
        lines.append(
            "crossover: "
            + "; ".join(f"{label(g)}: {crossover_text(g)}" for g in result.groups)
            + f" | threshold {result_n_text(result, result.recommended_threshold)}"
            + (" | unconfirmed: --confirm none" if result.confirm == "none" else f" | {confirmed} point(s) confirmed")
        )
        captures = [g for g in result.groups if g.fuse_or_capture is not None]
        if captures:
            lines.append("fuse or capture: " + "; ".join(f"{label(g)}: {capture_text(g)}" for g in captures))
    lines += bound_lines(result) + notes_digest(result) + ran_digest(result)
    skipped = Counter(f.message for p in points for s, f in p.failures.items() if f.kind == "skipped")
    lines += [f"skipped: {why}" + (f" ({k} points)" if k > 1 else "") for why, k in skipped.items()]
    lines += [f"FAILED: {f}" for f in result.failures]
    return "\n".join([*lines, *advice_lines(result)])


def _winner_text(group: "GroupResult", result: "BenchmarkResult") -> str:
    """The decision at the group's largest N, with its significant speedup."""
    largest = [p for p in result.points if p.params == group.params and p.n == group.n_values[-1]]
    if not largest or not largest[0].timings:
        return "-"
    point = largest[0]
    cell = decision_cell(point, confirmed_mark=False)
    if point.best_speedup is not None and cell.startswith("fuse"):
        lo, hi = point.speedup_ci[point.best_strategy]
        cell += f" {point.best_speedup:.2f}x [{lo:.2f},{hi:.2f}]"
    return f"N={point.n}: {cell}"


def _load_text(result: "BenchmarkResult") -> str:
    load = result.health.max_other_load_cores if result.health is not None else None
    return "-" if load is None else f"{load:.1f} cores"


def closing_table(results: Sequence["BenchmarkResult"]) -> str:
    """After a run of several ops, the answer per op and group: crossover (with marginal points),
    threshold, the decision at the largest N, fuse or capture, the most cores other processes
    used while the op measured (the load a DISTURBED reads against), and RELIABLE or the reason."""
    rows = []
    for r in results:
        axes = _varying([g.params for g in r.groups])
        for g in r.groups:
            label = params_text({a: g.params[a] for a in axes}) or "-"
            # one reason once: three points unstable alike said so three times in one cell
            reasons = "; ".join(dict.fromkeys(p.split(": ", 1)[1] for p in g.problems)) or "RELIABLE"
            reasons = reasons if r.complete else f"INCOMPLETE (its answer above says why); {reasons}"
            capture = capture_text(g).split(" (")[0] or "-"
            rows.append(
                [
                    r.op,
                    label,
                    crossover_text(g),
                    result_n_text(r, r.recommended_threshold),
                    _winner_text(g, r),
                    capture,
                    _load_text(r),
                    reasons,
                ]
            )
    header = ["op", "group", "crossover", "threshold", "at the largest N", "fuse or capture", "others' load"]
    header.append("reliable")
    reliable = sum(r.reliable for r in results)
    return f"ANSWERS ({reliable} of {len(results)} ops RELIABLE)\n" + format_table(header, rows)
