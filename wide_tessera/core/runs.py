"""Where measuring commands keep their runs: one file each in `.wide_tessera/runs/` under the
current directory (or $WIDE_TESSERA_RUNS), named so that they sort by time and say what ran,
and how a run is named back: a file, a short id, or an index (@-1 the latest).

The folder holds this machine's measurements, not the project's: it gets a .gitignore of its
own on creation (as pytest's cache does), and `-o FILE` writes wherever a file is meant to
be shared.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path
from typing import List, Sequence

from .errors import WideTesseraError
from .files import RESULTS, make_folder, results_target

__all__ = ["RUNS_ENV", "runs_dir", "prepare_runs_dir", "new_run_path", "saved_runs", "resolve_run"]

RUNS_ENV = "WIDE_TESSERA_RUNS"
_SUFFIX = ".json"


def runs_dir() -> Path:
    """$WIDE_TESSERA_RUNS, else .wide_tessera/runs under the current directory."""
    return Path(os.environ.get(RUNS_ENV) or Path.cwd() / ".wide_tessera" / "runs")


def prepare_runs_dir() -> Path:
    """The runs folder, made where it is missing (with a .gitignore that keeps it out of git);
    one WideTesseraError naming it and the reason where it cannot be made or written."""
    folder = runs_dir()
    try:
        make_folder(folder, "runs folder")
        ignore = folder / ".gitignore"
        if not ignore.exists():
            ignore.write_text("# wide_tessera's saved runs: this machine's measurements (see `wide_tessera runs`)\n*\n")
    except OSError as e:
        raise WideTesseraError(f"runs folder {folder}: cannot write there ({e.strerror or e})") from None
    return folder


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:60] or "run"


def new_run_path(command: str, ops: Sequence[str], preset: str, run_id: str) -> Path:
    """'20261123T231502Z_benchmark_gemm-conv1d_quick_3f2a9c.json' in the runs folder: the UTC
    time first (names sort by time), then what ran, then the run's id (two runs in one second
    keep both)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    what = _slug("-".join(ops)) if len(ops) <= 3 else f"{_slug('-'.join(ops[:2]))}-and-{len(ops) - 2}-more"
    name = f"{stamp}_{_slug(command)}_{what}_{_slug(preset)}_{run_id[:6]}{_SUFFIX}"
    return results_target(runs_dir() / name, RESULTS)


def saved_runs() -> List[Path]:
    """Every run file in the folder, oldest first (a missing folder has none; one that is not a
    folder is an error naming it: it was 'no run kept in .../afile yet')."""
    folder = runs_dir()
    if folder.exists() and not folder.is_dir():
        raise WideTesseraError(f"runs folder {folder} (${RUNS_ENV} or .wide_tessera/runs) is not a folder")
    try:
        names = sorted(p for p in folder.iterdir() if p.suffix == _SUFFIX and not p.name.startswith("."))
    except OSError:
        return []
    return [p for p in names if p.is_file()]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):  # a file being written, or damaged: not the one named
        return ""


def resolve_run(name: str) -> Path:
    """A file the user names: a path that exists, `@-K` (the K-th latest run), the start of a
    run's file name or id, or the run id of a result in it (each op of one command has its own:
    a markdown report names it, and `show` of it found nothing); one line,
    naming what there is, when nothing matches."""
    if Path(name).exists():
        return Path(name)
    runs = saved_runs()
    where = f"in {runs_dir()} ({len(runs)} saved run(s); `wide_tessera runs` lists them)"
    match = re.fullmatch(r"@-(\d+)", name)
    if match:
        k = int(match.group(1))
        if not 1 <= k <= len(runs):
            raise WideTesseraError(f"{name}: there is no such run {where}; @-1 is the latest")
        return runs[-k]
    found = [p for p in runs if p.name.startswith(name) or p.stem.split("_")[-1].startswith(name)]
    if not found and re.fullmatch(r"[0-9a-f]{4,12}", name):  # a result's own run id (`show --format markdown`
        found = [p for p in runs if f'"run_id": "{name}' in _text(p)]  # prints it): the file that holds it
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise WideTesseraError(f"{name}: names {len(found)} runs {where}; give more of it")
    raise WideTesseraError(f"{name}: no such file, and no run {where} is named so")
