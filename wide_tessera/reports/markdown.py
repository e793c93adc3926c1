"""Results as GitHub-flavoured Markdown: tables that render in a pull request, a comment or a report."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, List, Sequence

from ..core.job import params_text
from ..core.roles import BASELINE
from ..core.stats import MIN_EFFECT
from ..measurement.controls import legend
from .advice import advice_table
from .answer import crossover_text, decision_cell, interval_legend, result_n_text
from .text import controls_run, first_line, measured_points, no_speedup

if TYPE_CHECKING:
    from ..results.schema import BenchmarkResult, PointResult

__all__ = ["escape", "table", "result_markdown", "details_markdown", "headline"]


def escape(cell: object) -> str:
    """A value as Markdown text: on one line, its `|` not a column and its HTML not markup (a
    result named `<script>...` ran as a script in the notebook's Markdown view, as the HTML view
    escapes it)."""
    return html.escape(str(cell), quote=False).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[bool] = ()) -> str:
    """A Markdown table; columns flagged in `right` (numbers) are right-aligned."""
    align = ["---:" if i < len(right) and right[i] else "---" for i in range(len(header))]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(escape(c) for c in line) + " |" for line in lines)


def _speedup_cell(point: "PointResult", strategy: str) -> str:
    why = no_speedup(point, strategy)
    if why is not None:
        return why
    low, high = point.speedup_ci[strategy]
    text = f"{point.speedups[strategy]:.2f}x [{low:.2f}, {high:.2f}]"
    verdict = point.verdicts[strategy]
    return f"**{text}**" if verdict == "faster" else f"{text} n.s." if verdict == "same" else text


def headline(result: "BenchmarkResult") -> List[object]:
    """op, verdict, crossover, threshold, best significant speedup: one row of a report's headline table."""
    measured = bool(measured_points(result))
    provisional = "" if result.complete else " (provisional)"
    return [
        result.op,
        first_line(result).split(":")[0],  # the reasons have a column of their own
        result_n_text(result, result.crossover_n) + provisional if measured else "–",
        result_n_text(result, result.recommended_threshold) + provisional if measured else "–",
        "none significant" if result.best_speedup is None else f"{result.best_speedup:.2f}x",
    ]


HEADLINE_HEADER = ["op", "verdict", "crossover N", "threshold", "best speedup"]


def result_markdown(result: "BenchmarkResult", level: int = 3) -> str:
    """One result: its verdict, where it ran, speedups per point, crossover per group."""
    env = result.environment
    axes = list(result.points[0].params) if result.points else []
    shown = [*result.strategies, *controls_run(result)]
    header = ["N", *axes, "baseline ms", *shown, "decision"]
    rows = [
        [p.n, *(p.params[a] for a in axes), f"{p.timings['baseline']:.4g}" if p.timings else "–"]
        + [_speedup_cell(p, s) for s in shown]
        + [decision_cell(p)]
        for p in result.points
    ]
    right = [True, *(False for _ in axes), True, *(False for _ in shown), False]
    run = f", run `{result.run_id}`" if result.run_id else ""
    parts = [
        f"{'#' * level} {escape(result.op)} (preset {escape(result.preset)})",
        f"**{escape(first_line(result))}**",
        escape(
            f"{env.device}: {env.device_name}, {env.threads} threads, torch {env.torch_version}, timer {result.timer}"
            + ("" if result.compile == "none" else f", torch.compile {result.compile}")
            + f", mode {result.mode}, {result.duration_s:.1f} s"
        )
        + run,
        table(header, rows, right),
        " ".join(interval_legend(result)).replace("speedup [", "Speedup over the N separate calls [")
        + f" **Bold**: the whole interval above {1 + MIN_EFFECT:.2f}; n.s.: no significant difference."
        + (
            f" Controls make the loop cheaper without fusing ({legend(controls_run(result))}); they never win."
            if len(shown) > len(result.strategies)
            else ""
        ),
    ]
    if measured_points(result):
        provisional = "" if result.complete else " (provisional: the run is incomplete)"
        parts.append(
            table(
                [*axes, "crossover"],
                [[*(g.params[a] for a in axes), crossover_text(g)] for g in result.groups],
            )
            if result.groups
            else ""
        )
        best = "none significant" if result.best_speedup is None else f"{result.best_speedup:.2f}x"
        parts.append(
            f"crossover N: **{result_n_text(result, result.crossover_n)}**{provisional} · recommended threshold: "
            f"**{result_n_text(result, result.recommended_threshold)}** · best significant speedup: **{best}**"
        )
    else:
        parts.append("Nothing was measured: no verdict on fusing.")
    advice = advice_table(result)
    if advice is not None:
        title, header, rows = advice
        parts += [escape(title), table(header, rows)]
    return "\n\n".join(p for p in parts if p) + "\n"


def details_markdown(result: "BenchmarkResult") -> str:
    """Every timing with its percentiles: p50 [95% CI], p90, p99, speedup, verdict, correctness, memory."""
    rows = []
    for p in measured_points(result):
        for s in [BASELINE, *result.strategies, *controls_run(result)]:
            st = p.stats.get(s)
            if st is None:
                continue
            lo, hi = st.median_ci_ms
            speedup = f"{p.speedups[s]:.2f}x {p.verdicts[s]}" if s in p.speedups else ""
            memory = p.peak_memory_bytes.get(s)
            rows.append(
                [
                    p.n,
                    params_text(p.params),
                    s,
                    f"{st.median_ms:.4g} [{lo:.4g}, {hi:.4g}]",
                    f"{st.p90_ms:.4g}",
                    f"{st.p99_ms:.4g}",
                    st.n_samples,
                    speedup,
                    {True: "yes", False: "NO"}.get(p.correct.get(s), "reference"),
                    "–" if memory is None else f"{memory / 2**20:.3g}",
                ]
            )
    header = [
        "N",
        "parameters",
        "callable",
        "p50 ms [95% CI]",
        "p90 ms",
        "p99 ms",
        "samples",
        "speedup",
        "correct",
        "peak MiB",
    ]
    return table(header, rows, [True, False, False, True, True, True, True, False, False, True])
