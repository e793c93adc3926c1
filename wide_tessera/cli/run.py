"""A measuring command's run (benchmark, custom, tune): its options checked into settings and jobs
before anything is measured, the jobs measured and saved as they go, what they found said, and
the exit status chosen."""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import click
import torch

from ..core.errors import Interrupted, WideTesseraError
from ..core.files import RESULTS, held_by, make_folder, results_lock, results_target
from ..core.job import BenchmarkJob
from ..core.runs import new_run_path, prepare_runs_dir, saved_runs
from ..dispatch.table import check_table_target, merge_into
from ..kernels import autotuned_kernels, triton_unavailable_reason
from ..kernels.facts import CompileClock
from ..kernels.facts import dump_ir as write_ir
from ..measurement.roofline import cache_path
from ..measurement.settings import RunSettings
from ..ops.registry import import_ops
from ..reports.brief import closing_table
from ..reports.compare import against_previous
from ..results.load import load_results
from ..results.schema import BenchmarkResult, save_results
from ..sweep.progress import Progress
from ..sweep.runner import check_runnable
from ..sweep.session import measure_jobs, measure_shard, points_to_measure, previous_results
from ..sweep.shards import Shard, leftover_shards, rank_device, rank_threads
from .load_watch import LoadWatch
from .options import check_directory, override_texts, settings_from, usage_errors

__all__ = ["run_measuring", "MakeJobs"]

# How many kept runs, newest first, a run looks back through for one measured alike: a run of
# other ops or settings in between does not hide the last one that was.
_RUNS_LOOKED_BACK = 5

MakeJobs = Callable[[RunSettings, Dict[str, List[str]]], List[BenchmarkJob]]


def run_measuring(
    make_jobs: MakeJobs,
    preset: str,
    *,
    imports: Tuple[str, ...],
    output: Optional[str],
    resume: bool,
    n_values: Optional[str],
    sets: Tuple[str, ...],
    threads: Union[None, int, str],
    dump_ir: Optional[str],
    strict: bool,
    quiet: bool,
    save_dispatch: Optional[str],
    command: str,
    no_save: bool,
    overwrite: bool = False,
    output_option: str = "-o",
    **given: Any,
) -> None:
    """Check every option, build the jobs, measure them, saving as they go (to -o FILE, and to
    the runs folder unless --no-save); exit with the run's status."""
    with ExitStack() as held:
        with usage_errors():
            import_ops(imports)
            texts = override_texts(sets, n_values)
            _check_output(output, resume, overwrite, output_option)
            if dump_ir:
                check_directory(dump_ir, "--dump-ir")
            settings, shard = _settings(preset, threads, n_values, held, given)
            jobs = make_jobs(settings, texts)
            for job in jobs:
                check_runnable(job, settings)
            _check_trace_n(jobs, settings)
            if output and _writes(shard):
                held.enter_context(results_lock(output))  # until the last save: one writer per file
            # read once, under the lock: the file as its last writer left it (1 MB of 19 results: 2 s)
            saved = load_results(output) if resume and output is not None and Path(output).exists() else []
            if resume and threads is None and shard is None:
                threads = _threads_measured(saved)
                if threads is not None:
                    torch.set_num_threads(threads)
                    click.echo(f"--resume: measuring with {threads} thread(s), as {output} was measured", err=True)
            # after the input is checked (a bad value is the one line said), before --resume
            # compares the threads of what it keeps, which the load may set here
            load = LoadWatch(threads, settings.timing) if shard is None and settings.device == "cpu" else None
            run = _Run(command, settings, jobs, shard, load, save_dispatch, output)
            run.say_load(lambda said: click.echo(said, err=True))
            if save_dispatch is not None and run.writer:  # locked by each merge, not the run: first calls write it too
                check_table_target(save_dispatch, output)
            previous = previous_results(output, saved, settings, shard is not None) if resume else {}
        run_file = _run_file(command, jobs, preset) if run.writer and not no_save else None
        saved_to = output or run_file  # saved after every point: -o FILE, else the run file (a name no other run takes)
        # --dump-ir: clock every Triton compilation of the run (nothing without triton)
        clock = held.enter_context(CompileClock()) if dump_ir and triton_unavailable_reason("cuda") is None else None
        kept, results, errors, unsaved = run.measure(held, previous, saved_to, quiet)
        _close(kept, results, run_file, output)
        code = _report(results, kept, saved_to, unsaved, dump_ir, strict, errors, clock)
        if shard is not None:
            shard.broadcast(code)
        if code:
            raise SystemExit(code)


def _close(
    kept: List[BenchmarkResult], results: List[BenchmarkResult], run_file: Optional[str], output: Optional[str]
) -> None:
    """The closing table of a run of several ops, how it fares against the last run measured alike,
    and the kept run's own copy where -o FILE was written."""
    if len(results) > 1:
        click.echo(closing_table(results))
    if run_file is None:
        return
    note = _against_previous_run(results, [run_file, output])
    if note is not None:
        click.echo(note)
    if output is not None:  # -o FILE was written; the runs folder keeps the run too
        try:
            save_results([*kept, *results], run_file)
        except WideTesseraError as e:
            click.echo(f"{e}: this run is kept in {output} only", err=True)


def _threads_measured(saved: List[BenchmarkResult]) -> Optional[int]:
    """The thread count every result a --resume continues was measured with, where they agree: a
    resume that names none continues with it. Left to the machine's load, a resume beside another
    process chose 1 where the file had 2, and was refused ("measured with threads 2; this run
    asks for threads 1"); LoadWatch names a machine too busy for it, as for --threads K."""
    counts = {r.environment.threads for r in saved}
    return counts.pop() if len(counts) == 1 else None


def _writes(shard: Optional[Shard]) -> bool:
    """Whether this process writes the results file and the table: rank 0 under torchrun."""
    return shard is None or shard.rank == 0


def _settings(
    preset: str, threads: Union[None, int, str], n_values: Optional[str], held: ExitStack, given: Dict[str, Any]
) -> Tuple[RunSettings, Optional[Shard]]:
    """The run's settings from its options, and its shard under torchrun (its device, threads and
    share of the points); the threads set for the run, the caller's own again after it."""
    auto = threads == "auto"
    settings = settings_from(preset, threads=None if auto else threads, **given)
    if settings.search is not None and n_values is not None:
        raise WideTesseraError(
            f"--search {':'.join(map(str, settings.search))} chooses the N values itself: give --search or "
            f"--n-values {n_values}, not both"
        )
    if settings.trace:
        check_directory(settings.trace, "--trace")
    if settings.roofline:  # the measured peaks are cached there once the first job starts
        make_folder(cache_path().parent, "roofline cache folder")
    held.callback(torch.set_num_threads, torch.get_num_threads())  # an in-process caller keeps its own
    shard = Shard.from_environment()
    if shard is not None:
        shard.join(settings.device)
        held.callback(shard.leave)
        settings = dataclasses.replace(settings, device=rank_device(settings.device))
        torch.set_num_threads(rank_threads() if auto or threads is None else int(threads))
    elif threads is not None and not auto:
        torch.set_num_threads(int(threads))
    return settings, shard


class _Run:
    """A measuring command's run once its input is checked: its jobs measured (this rank's share
    under torchrun), each op's answer said as it finishes, merged into the dispatch table where
    one is named, and the load probed between ops."""

    def __init__(
        self,
        command: str,
        settings: RunSettings,
        jobs: List[BenchmarkJob],
        shard: Optional[Shard],
        load: Optional[LoadWatch],
        save_dispatch: Optional[str],
        output: Optional[str],
    ):
        self.command, self.settings, self.jobs, self.shard, self.load = command, settings, jobs, shard, load
        self.save_dispatch, self.output = save_dispatch, output
        self.writer = _writes(shard)
        self.in_table: List[str] = []  # the ops merged into the dispatch table so far

    def say_load(self, echo: Callable[[str], Any]) -> None:
        said = self.load.check() if self.load is not None else None
        if said:
            echo(said)

    def measure(
        self, held: ExitStack, previous: Dict[str, BenchmarkResult], saved_to: Optional[str], quiet: bool
    ) -> Tuple[List[BenchmarkResult], List[BenchmarkResult], List[str], List[str]]:
        """The results kept from before (--resume), this run's, the ranks' errors and what could
        not be saved. What fails only mid-run (a folder changed or vanished under the run) is one
        line too, as bad input is; the points measured by then are in the results file (saved
        after each). Ctrl-C exits 130, saying how to continue."""
        jobs, settings, shard = self.jobs, self.settings, self.shard
        with usage_errors():
            try:
                if shard is None:
                    progress = held.enter_context(
                        closing(Progress(points_to_measure(jobs, settings, previous), enabled=not quiet))
                    )
                    kept, results, unsaved = measure_jobs(
                        jobs, settings, previous, saved_to, progress, lambda r: self.finished(r, progress)
                    )
                    return kept, results, [], unsaved
                # each rank's lines labelled, and no bar: K bars on one terminal overwrite each other
                progress = held.enter_context(closing(Progress(0, enabled=not quiet, label=f"[rank {shard.rank}] ")))
                gathered = measure_shard(jobs, settings, previous, saved_to, progress, shard)
                if gathered is None:  # not rank 0: rank 0 reports, and says how the run ends
                    raise SystemExit(shard.broadcast(None))
                kept, results, errors = gathered
                for result in results:
                    self.finished(result, progress)
                return kept, results, errors, []  # rank 0 wrote the joined file above, or raised
            except Interrupted as stop:
                click.echo(self._interrupted(stop), err=True)
                raise SystemExit(130) from None

    def finished(self, result: BenchmarkResult, progress: Progress) -> None:
        """Say an op's answer as soon as it is done, probe the load before the next op, and merge
        the answer into the dispatch table."""
        progress.echo(result.brief() + "\n")
        self.say_load(lambda said: progress.echo(said + "\n"))
        table = self.save_dispatch
        try:
            merged = merge_into(table, result) if table is not None else None
        except WideTesseraError as e:  # the table changed under the run: the answer above stands
            merged = f"dispatch table {table}: {result.op} not merged: {e}"
        else:
            self.in_table.extend([result.op] if merged and result.complete else [])
        if merged:
            progress.echo(merged + "\n")

    def _interrupted(self, stop: Interrupted) -> str:
        ops = ", ".join(self.in_table) or "no op had finished"
        table = f"; in the dispatch table {self.save_dispatch}: {ops}" if self.save_dispatch else ""
        said = f"\ninterrupted: {stop}{table}" if stop.output else f"\ninterrupted ({stop}){table}"
        return said + _how_to_continue(self.command, stop.output, self.output, self.jobs, self.in_table)


def _check_output(path: Optional[str], resume: bool, overwrite: bool, option: str = "-o") -> None:
    """The results file a run writes: a file of results only is continued (--resume) or replaced
    (--overwrite); anything else is refused, naming what it holds (files.results_target)."""
    if path is None:
        if resume:
            raise WideTesseraError("--resume needs -o FILE: the results file to continue")
        if overwrite:
            raise WideTesseraError("--overwrite replaces the results -o FILE holds: give -o FILE, or leave it out")
        return
    if resume and overwrite:
        raise WideTesseraError(f"--resume continues {path} and --overwrite replaces it: give one of them")
    try:
        results_target(path, RESULTS)
    except WideTesseraError as e:
        raise WideTesseraError(f"{option} {e}") from None
    if resume and not Path(path).exists() and not leftover_shards(path):
        raise WideTesseraError(f"--resume: {path} does not exist; run without --resume to start it")
    if not resume and not overwrite and held_by(path) == RESULTS:
        raise WideTesseraError(
            f"{option} {path}: holds results already; --resume continues it, --overwrite replaces it, "
            "or give another file"
        )


def _against_previous_run(results: List[BenchmarkResult], own: Sequence[Optional[str]]) -> Optional[str]:
    """How this run's crossovers fare in the latest kept run before it that measured some of its
    ops alike (reports.compare.against_previous); None where none of the last few did. `own`: the
    files this run wrote (its kept run, and its -o, a kept run's own file when --resume continued it)."""
    mine = {Path(path).resolve() for path in own if path is not None}
    earlier_runs = [p for p in saved_runs() if p.resolve() not in mine]
    for path in reversed(earlier_runs[-_RUNS_LOOKED_BACK:]):
        try:
            earlier = load_results(path)
        except WideTesseraError:  # a damaged file, or one of another version: it says nothing here
            continue
        note = against_previous(earlier, results, path.name)
        if note is not None:
            return note
    return None


def _run_file(command: str, jobs: Sequence[BenchmarkJob], preset: str) -> Optional[str]:
    """Where this run is kept (core.runs); None, with one line saying why, where it cannot be."""
    try:
        prepare_runs_dir()
        return str(new_run_path(command, [job.op for job in jobs], preset, uuid.uuid4().hex))
    except WideTesseraError as e:
        click.echo(f"{e}: this run is not kept (--no-save skips keeping it)", err=True)
        return None


def _how_to_continue(
    command: str, saved: Optional[str], given: Optional[str], jobs: Sequence[BenchmarkJob], done: Sequence[str]
) -> str:
    """The command that continues an interrupted run, as it can be run: tune has no --resume (the
    ops not in its table are tuned again), and --resume needs -o, which a run kept in the runs
    folder only was not given."""
    if command == "tune":
        rest = [job.op for job in jobs if job.op not in done]
        return f"; to measure the rest: wide_tessera tune {' '.join(rest)} (with the same options)" if rest else ""
    if saved is None:
        return ""
    added = "--resume" if given is not None else f"--resume -o {saved}"
    return f"; continue it: the same command with {added}"


def _report(
    results: List[BenchmarkResult],
    kept: List[BenchmarkResult],
    output: Optional[str],
    unsaved: List[str],
    ir_directory: Optional[str],
    strict: bool,
    errors: List[str],
    clock: Optional[CompileClock],
) -> int:
    """Write the IR, list what failed, and say how the run ends: its exit status (every one
    a run can end with is chosen here, and listed in docs/cli.md)."""
    if output and not unsaved:
        click.echo(f"wrote {len(kept) + len(results)} result(s) to {output}", err=True)
    if ir_directory:
        if triton_unavailable_reason("cuda") is not None:  # no triton at all
            click.echo(f"--dump-ir: nothing written: the Triton kernels {triton_unavailable_reason('cuda')}", err=True)
        else:
            try:
                written = write_ir(autotuned_kernels(), Path(ir_directory), clock)
                click.echo(f"--dump-ir: wrote {len(written)} file(s) to {ir_directory}", err=True)
            except (WideTesseraError, OSError) as e:
                click.echo(f"--dump-ir: {e}", err=True)
    traces = [path for r in results for p in r.points for path in p.traces]
    if traces:
        click.echo(
            f"{len(traces)} trace(s), for chrome://tracing or ui.perfetto.dev:\n  " + "\n  ".join(traces), err=True
        )
    failures = [*errors, *(f"{r.op}: {f}" for r in results for f in r.failures)]
    if failures:
        click.echo(f"{len(failures)} failure(s):\n  " + "\n  ".join(failures), err=True)
        return 1
    if unsaved:  # what was measured is not all kept: worse than an unreliable result
        click.echo(f"{output}: the latest points are not in it (why is said above); exit status 4", err=True)
        return 4
    unreliable = [f"{r.op}: {'; '.join(r.unreliable_reasons)}" for r in results if not r.reliable]
    if strict and unreliable:
        click.echo(f"--strict: {len(unreliable)} unreliable result(s):\n  " + "\n  ".join(unreliable), err=True)
        return 3
    return 0



def _check_trace_n(jobs: List[BenchmarkJob], settings: RunSettings) -> None:
    """--trace-n names Ns the run measures (a search measures the Ns it chooses: not checked)."""
    if settings.trace_n is None or settings.search is not None:
        return
    measured = sorted({n for job in jobs for n in job.sweep.n_values})
    missing = [n for n in settings.trace_n if n not in measured]
    if missing:
        raise WideTesseraError(
            f"--trace-n {','.join(map(str, missing))}: this run measures no such N (its N values: "
            f"{', '.join(map(str, measured))}), so nothing would be traced"
        )
