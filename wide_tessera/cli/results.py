"""The commands that read results: `show`, `compare`, `plot` and `report`."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from ..collectives.cases import CollectivesRun, is_collectives_file, load_collectives
from ..collectives.cases import rows as collective_rows
from ..collectives.plots import plot_collectives
from ..collectives.torchrun import summary
from ..core.runs import resolve_run
from ..core.user_input import check_number
from ..reports import markdown, tidy
from ..reports.compare import compare, render
from ..reports.page import write_report
from ..reports.plots import plot_result
from ..results.load import load_results
from ..results.schema import BenchmarkResult
from .options import check_directory, usage_errors

__all__ = ["show", "compare_runs", "plot", "report"]


def _named(paths: Sequence[str]) -> List[str]:
    """The files the user names: paths, `@-K` (the K-th latest kept run) or a run's id (core.runs);
    none named: the latest run."""
    with usage_errors():
        return [str(resolve_run(name)) for name in (paths or ["@-1"])]


def _load_files(paths: Sequence[str]) -> Tuple[List[CollectivesRun], List[BenchmarkResult]]:
    """The collectives runs and the results of files written by `collectives -o` and `benchmark -o`."""
    collective = [is_collectives_file(p) for p in paths]
    with usage_errors():
        runs = [load_collectives(p) for p, c in zip(paths, collective) if c]
    return runs, _load_all([p for p, c in zip(paths, collective) if not c])


def _load_all(paths: Sequence[str]) -> List[BenchmarkResult]:
    """Every result of every file, in order; a bad file is a usage error naming it."""
    with usage_errors():
        return [r for path in paths for r in load_results(path)]


@click.command()
@click.argument("paths", nargs=-1, metavar="[FILE|@-K|ID]...")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "markdown", "csv", "json"]),
    default="table",
    show_default=True,
    help="table: the summaries; markdown: for a pull request; csv, json: the tidy rows (one per N, parameters, "
        "strategy).",
)
@click.option(
    "--warnings", "all_warnings", is_flag=True, help="List every warning, not only the digest (table format)."
)
def show(paths: Tuple[str, ...], fmt: str, all_warnings: bool) -> None:
    """Print the results stored in files written by `benchmark -o` (or by `collectives -o`: their table or rows);
    without a file, the latest kept run (`wide_tessera runs`).

    \b
    Examples:
      wide_tessera show
      wide_tessera show @-2
      wide_tessera show results.json
      wide_tessera show gemm.json conv.json --format markdown >> $GITHUB_STEP_SUMMARY
      wide_tessera show results.json --format csv > results.csv   (pd.read_csv reads it)
    """
    runs, results = _load_files(_named(paths))
    if fmt in ("csv", "json") and runs and results:
        raise click.UsageError(
            "--format csv and json print one kind of row: give results files or collectives files, not both"
        )
    if runs:
        table = [row for run in runs for row in collective_rows(run)]
        if fmt == "csv":
            _write_csv(table, list(table[0]) if table else [])
        elif fmt == "json":
            click.echo(json.dumps(table, indent=1, allow_nan=False))
        else:  # the table, as the run printed it (markdown too)
            click.echo("\n\n".join(summary(run) for run in runs))
    if fmt == "csv" and results:
        table = tidy.rows(results)
        _write_csv(table, tidy.column_order(table))
    elif fmt == "json" and results:
        click.echo(json.dumps(tidy.rows(results), indent=1, allow_nan=False))
    elif fmt == "markdown":
        click.echo("\n".join(markdown.result_markdown(r) for r in results), nl=False)
    else:
        for result in results:
            click.echo(result.summary() + "\n")
            if all_warnings:
                click.echo(f"all {len(result.warnings)} warning(s) of {result.op}:")
                click.echo("".join(f"  {w}\n" for w in result.warnings))


def _write_csv(table: List[Dict[str, Any]], fields: List[str]) -> None:
    writer = csv.DictWriter(sys.stdout, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(table)


@click.command("compare")
@click.argument("base", metavar="[BASE]", required=False)
@click.argument("new", metavar="[NEW]", required=False)
@click.option("--format", "fmt", type=click.Choice(["table", "markdown"]), default="table", show_default=True)
@click.option(
    "--fail-on-regression",
    "fail_percent",
    type=float,
    default=None,
    metavar="PCT",
    help="Exit 1 when a timing is significantly slower by more than PCT percent, a strategy broke, or a crossover "
        "moved to a larger N.",
)
def compare_runs(base: Optional[str], new: Optional[str], fmt: str, fail_percent: Optional[float]) -> None:
    """Compare two results files point by point: changes in time with their 95% CI, and crossovers.
    With one file, it against the latest kept run; with none, the latest two kept runs.

    \b
    Examples:
      wide_tessera compare
      wide_tessera compare main.json
      wide_tessera compare main.json branch.json
      wide_tessera compare main.json branch.json --fail-on-regression 10 --format markdown > comment.md

    Exit status: 0; 1 with --fail-on-regression when there is a regression; 2 for bad input.
    """
    with usage_errors():
        if fail_percent is not None:
            check_number("--fail-on-regression", fail_percent, 0, 1e6, low_ok=True)
    if base is None:
        base, new = "@-2", "@-1"
    base, new = _named([base, new or "@-1"])
    comparison = compare(_load_all([base]), _load_all([new]))
    if not comparison.changes:
        raise click.UsageError(
            f"{base} and {new} share no measured point (same op, parameters and N): nothing to compare"
        )
    click.echo(render(comparison, fmt == "markdown", fail_percent), nl=False)
    if fail_percent is not None and comparison.regressions(fail_percent):
        sys.exit(1)


@click.command()
@click.argument("paths", nargs=-1, metavar="[FILE|@-K|ID]...")
@click.option("-o", "--output", required=True, metavar="DIR", help="Directory for the plots (PNG and SVG).")
def plot(paths: Tuple[str, ...], output: str) -> None:
    """Draw each op's parameter groups: speedup, time and memory against N, and speed against memory.

    Needs matplotlib: pip install 'wide_tessera[plot]'.
    """
    runs, results = _load_files(_named(paths))
    with usage_errors():
        check_directory(output)
        written = [path for r in results for path in plot_result(r, Path(output))]
        written += [path for run in runs for path in plot_collectives(run, Path(output))]
    click.echo(f"wrote {len(written)} file(s) to {output}")


@click.command()
@click.argument("paths", nargs=-1, metavar="[FILE|@-K|ID]...")
@click.option("-o", "--output", required=True, metavar="DIR", help="Directory for README.md and its plots.")
def report(paths: Tuple[str, ...], output: str) -> None:
    """Write one Markdown page: the environment, the headline per op, the tables and the plots.

    DIR/README.md renders on GitHub as it is; without matplotlib it has no plots and says so.
    """
    paths = _named(paths)
    results = _load_all(paths)
    with usage_errors():
        check_directory(output)
        page = write_report(results, Path(output), paths)
    click.echo(f"wrote {page}")

