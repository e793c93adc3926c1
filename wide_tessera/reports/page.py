"""A report: one Markdown page with the environment, the headline per op, the tables and the plots.

Written as README.md in its directory, with the plots beside it in plots/, so that GitHub
renders it as it is (a directory of a repository, a pull request, an artifact).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Sequence

from ..core.errors import WideTesseraError
from ..core.files import REPORT, make_folder, results_target, write_atomic
from ..results.manifest import now
from . import markdown

if TYPE_CHECKING:
    from ..results.manifest import Manifest
    from ..results.schema import BenchmarkResult

__all__ = ["write_report"]


def _environment(results: Sequence["BenchmarkResult"]) -> str:
    """The manifest of the first run of the first result, and which results ran elsewhere."""
    runs: List["Manifest"] = [m for r in results for m in r.runs]
    if not runs:
        env = results[0].environment
        where = f"{env.device}: {env.device_name}, torch {env.torch_version}"
        return f"No run manifest (a file from before manifests). {where}."
    m = runs[0]
    gpu = ", ".join(f"{k} {v}" for k, v in m.gpu.items()) or "none"
    git = (
        "not a git repository"
        if m.git is None
        else f"`{m.git.commit[:12]}` on {m.git.branch}" + (" (dirty)" if m.git.dirty else "")
    )
    finished = [x.finished for x in runs]
    rows = [
        ["command", f"`{' '.join(m.command)}`"],
        [
            "started / finished (UTC)",
            f"{min(x.started for x in runs)} / {max(finished) if all(finished) else 'unfinished'}",
        ],
        ["code (git, in " + m.cwd + ")", git],
        ["host", m.host],
        ["CPU", f"{m.cpu}: {m.cores} cores, {m.usable_cores} usable, governor {m.governor or 'not shown'}"],
        ["GPU", gpu],
        ["versions", ", ".join(f"{k} {v}" for k, v in m.versions.items() if v)],
        ["environment", ", ".join(f"`{k}={v}`" for k, v in m.env.items()) or "no variable that changes timings is set"],
        ["seed", str(m.seed)],
    ]
    # What the table above does not describe: results measured under another command, host, code or software.
    others = {
        what: sorted({f"{r.op} ({value(x)})" for r in results for x in r.runs if value(x) != value(m)})
        for what, value in [
            ("command", lambda x: " ".join(x.command)),
            ("host", lambda x: x.host),
            ("git commit", lambda x: x.git.commit[:12] if x.git else "no git"),
            ("versions", lambda x: ", ".join(f"{k} {v}" for k, v in x.versions.items() if v)),
        ]
    }
    note = "".join(f"\n\nMeasured with another {what}: {'; '.join(ops)}." for what, ops in others.items() if ops)
    resumed = [r.op for r in results if len(r.runs) > 1]
    note += f"\n\nResumed (more than one run): {', '.join(resumed)}." if resumed else ""
    return markdown.table(["", "this run"], rows) + note


def write_report(results: Sequence["BenchmarkResult"], directory: Path, sources: Sequence[str] = ()) -> Path:
    """Write DIRECTORY/README.md (and plots/ where matplotlib is installed); the page's path."""
    if not results:
        raise WideTesseraError("report: no results to report")
    directory = Path(directory)
    make_folder(directory, "report folder")
    page = directory / "README.md"
    results_target(page, REPORT)  # before any plot is drawn: a README of the user's is kept, and nothing is added
    try:
        from .plots import plot_result

        ops = [r.op for r in results]
        # An op reported twice (two files) gets a directory per result, so its plots do not overwrite each other.
        folders = [op if ops.count(op) == 1 else f"{op}-{ops[:i].count(op) + 1}" for i, op in enumerate(ops)]
        plots = {id(r): plot_result(r, directory / "plots" / folder) for r, folder in zip(results, folders)}
        plot_note = ""
    except WideTesseraError as e:  # no matplotlib: the page without pictures, and why
        plots, plot_note = {}, f"\n\nNo plots: {e}."
    headlines = [[*markdown.headline(r), "; ".join(r.unreliable_reasons) or "–"] for r in results]
    parts = [
        "# wide_tessera report",
        f"Written {now()} from {', '.join(f'`{s}`' for s in sources) or 'results'}." + plot_note,
        "## Environment",
        _environment(results),
        "## Headlines",
        markdown.table([*markdown.HEADLINE_HEADER, "why unreliable"], headlines),
        "Crossover N: the N from which fusing wins for at least half the parameter groups; threshold: the N "
        "from which it wins in every group that ever wins; best speedup: the largest significant, confirmed one.",
    ]
    for r in results:
        parts.append(f"## {markdown.escape(r.op)}")
        parts.append(markdown.result_markdown(r, level=3).split("\n", 2)[2])  # its own heading is the section's
        for png in (p for p in plots.get(id(r), []) if p.suffix == ".png"):
            rel = png.relative_to(directory).as_posix()
            parts.append(f"[![{png.stem}]({rel})]({rel[:-4]}.svg)")
        parts.append(
            "<details><summary>every timing: p50 with its 95% CI, p90, p99</summary>\n\n"
            + markdown.details_markdown(r)
            + "\n\n</details>"
        )
    write_atomic(page, "\n\n".join(parts) + "\n", REPORT)
    return page
