"""`wide_tessera runs`: the kept runs, newest last, each with what it answered."""

from __future__ import annotations

import click

from ..collectives.cases import is_collectives_file, load_collectives
from ..core.errors import WideTesseraError
from ..core.runs import runs_dir, saved_runs
from ..reports.answer import result_n_text
from ..reports.text import format_table
from ..results.load import load_results
from .options import usage_errors

__all__ = ["runs"]


@click.command()
def runs() -> None:
    """List the runs the measuring commands kept (.wide_tessera/runs under this folder, or
    $WIDE_TESSERA_RUNS): when, what, preset, device, reliable or not, each op's threshold.
    Name one in show, plot, report or compare by @-K (@-1 the latest) or by its id.

    A damaged file in the folder is listed as such and hides no other.
    """
    with usage_errors():
        paths = saved_runs()
    rows = []
    for k, path in enumerate(paths):
        index, run_id = f"@-{len(paths) - k}", path.stem.split("_")[-1]
        when = path.name[:16]
        try:
            if is_collectives_file(path):
                run = load_collectives(path)
                rows.append(
                    [
                        index,
                        run_id,
                        when,
                        "collectives",
                        "-",
                        f"{run.backend} x{run.ranks}",
                        "-",
                        f"{len(run.results)} cases",
                    ]
                )
                continue
            results = load_results(path)
        except WideTesseraError as e:
            rows.append([index, run_id, when, "DAMAGED", "-", "-", "-", str(e).split(": ", 1)[-1][:80]])
            continue
        if not results:
            rows.append([index, run_id, when, "-", "-", "-", "-", "no result"])
            continue
        first = results[0]
        reliable = sum(r.reliable for r in results)
        complete = "" if all(r.complete for r in results) else ", INCOMPLETE"
        rows.append([
            index, run_id, when, ",".join(r.op for r in results), first.preset, first.device,
            f"{reliable}/{len(results)} reliable{complete}",
            " ".join(f"{r.op}:{result_n_text(r, r.recommended_threshold)}" for r in results),
        ])  # fmt: skip
    if not rows:
        click.echo(f"no run kept in {runs_dir()} yet: benchmark, custom, tune and collectives keep theirs there")
        return
    header = ["run", "id", "when (UTC)", "ops", "preset", "device", "reliable", "threshold per op"]
    click.echo(f"{len(rows)} run(s) in {runs_dir()}\n" + format_table(header, rows))
