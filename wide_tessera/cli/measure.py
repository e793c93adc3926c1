"""The commands that measure: `benchmark` (registered ops), `custom` (your nn.Module class) and
`tune` (the dispatch table fuse() reads). They check every option, build the jobs, hand them to
sweep.session, print what it found and choose the exit status."""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import click
import torch

from ..api import build_custom_job, build_job
from ..core.errors import Interrupted, MissingDependency, WideTesseraError
from ..core.files import RESULTS, held_by, make_folder, results_lock, results_target
from ..core.job import BenchmarkJob, SweepParams
from ..core.runs import new_run_path, prepare_runs_dir, saved_runs
from ..dispatch.table import (
    TABLE_ENV,
    check_table_target,
    default_table_path,
    merge_into,
)
from ..kernels import autotuned_kernels, triton_unavailable_reason
from ..kernels.facts import CompileClock
from ..kernels.facts import dump_ir as write_ir
from ..measurement.health import HealthMonitor, free_cores, load_remedy, probe_load, usable_cpus
from ..measurement.modes import TRAINING_MODES
from ..measurement.roofline import cache_path
from ..measurement.settings import RunSettings
from ..measurement.timing import TimingConfig, cpu_clock
from ..ops.registry import get_op, import_ops, op_names
from ..reports.brief import closing_table
from ..reports.compare import against_previous
from ..results.load import load_results
from ..results.schema import BenchmarkResult, save_results
from ..sweep.progress import Progress
from ..sweep.runner import check_runnable, search_candidates
from ..sweep.session import (
    measure_jobs,
    measure_shard,
    points_to_measure,
    previous_results,
)
from ..sweep.shards import Shard, leftover_shards, rank_device, rank_threads
from ..widen.custom import INPUT_DTYPES, RANDOMNESS
from .options import (
    DEVICE,
    IMPORT,
    NO_SAVE,
    QUIET,
    RUN_OPTIONS,
    SAMPLING,
    SELECTION,
    check_directory,
    load_object,
    model_kwargs,
    options,
    override_texts,
    parse_shape,
    settings_from,
    usage_errors,
)

__all__ = ["benchmark", "custom", "tune"]

# How many kept runs, newest first, a run looks back through for one measured alike: a run of
# other ops or settings in between does not hide the last one that was.
_RUNS_LOOKED_BACK = 5

_EXIT_STATUS = """
    Exit status: 0 when every strategy ran and was correct; 1 when any was incorrect,
    failed, timed out or crashed; 2 for bad input; 4 when -o FILE could not be written
    with the latest points; 3 with --strict when a result is unreliable; 130 when
    interrupted (what was measured is saved, marked incomplete).
"""

MakeJobs = Callable[[RunSettings, Dict[str, List[str]]], List[BenchmarkJob]]


def build_jobs(
    names: Sequence[str], preset: str, device: str, texts: Dict[str, List[str]], verbose: bool, every_op: bool = False
) -> List[BenchmarkJob]:
    """One job per op (an op named twice, or by an alias too, runs once), its overrides read by its own axes.

    every_op: a run of every registered op, which skips, with the reason, an op missing an optional package.
    """
    jobs = []
    for op in dict.fromkeys(get_op(name).NAME for name in names):
        try:
            jobs.append(
                build_job(op, preset, device, get_op(op).benchmark_job(preset).sweep.parse_overrides(texts), verbose)
            )
        except MissingDependency as e:
            if not every_op:
                raise
            click.echo(f"[{op}] SKIPPED: {e}", err=True)
    return jobs


@click.command()
@click.argument("names", nargs=-1)
@click.option("--all", "run_all", is_flag=True, help="Benchmark every registered op.")
@click.option("--preset", default="full", show_default=True, help="Sweep preset: ci, quick or full.")
@RUN_OPTIONS
def benchmark(names: Tuple[str, ...], run_all: bool, preset: str, **given: Any) -> None:
    """Benchmark ops: N separate calls against every wide strategy.

    \b
    Examples:
      wide_tessera benchmark --all --preset quick
      wide_tessera benchmark conv1d conv2d --preset ci -o results.json
      wide_tessera benchmark gemm --n-values 4,8 --set batch=64 --set dtype=float32,bfloat16
      wide_tessera benchmark flash_attention --preset quick --device cuda --cuda-graph
      wide_tessera benchmark --all --preset full --isolate -o full.json   (Ctrl-C, then add --resume)
      wide_tessera benchmark --import my_pkg.my_ops my_op --preset ci
    """

    def jobs(settings: RunSettings, texts: Dict[str, List[str]]) -> List[BenchmarkJob]:
        if run_all == bool(names):
            raise WideTesseraError("name one or more ops, or give --all (see `wide_tessera list`)")
        return build_jobs(
            op_names() if run_all else names, preset, settings.device, texts, not given["quiet"], every_op=run_all
        )

    _measure(jobs, preset, command="benchmark", **given)


benchmark.help += _EXIT_STATUS


@click.command()
@click.argument("model")
@click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    metavar="D1,D2,...",
    help="One model's input shape; repeat for a module of several inputs.",
)
@click.option(
    "--input-dtype",
    "input_dtypes",
    multiple=True,
    type=click.Choice(list(INPUT_DTYPES)),
    help="Each input's dtype, in order (float: the run's dtype; integers are drawn from [0, --int-high)).",
)
@click.option(
    "--int-high", type=int, default=None, help="Exclusive bound of integer inputs' values (e.g. a vocabulary size)."
)
@click.option(
    "--input-factory",
    default=None,
    metavar="MODULE:FUNCTION",
    help="A function of no arguments returning one model's input (a tensor, a tuple of positional arguments or a "
    "dict of keyword arguments), instead of --input-shape.",
)
@click.option(
    "--randomness",
    type=click.Choice(RANDOMNESS),
    default="error",
    show_default=True,
    help="vmap's randomness, for models that draw random numbers (dropout in train mode).",
)
@click.option(
    "--train",
    is_flag=True,
    help="Run the models in train mode (dropout active) in --mode inference too (without autograd).",
)
@click.option(
    "--kwarg", "kwargs", multiple=True, metavar="NAME=VALUE", help="An argument of MODEL (repeatable)."
)
@click.option(
    "--config",
    default=None,
    metavar="MODULE:CLASS",
    help="A config class (transformers:LlamaConfig), built from --config-kwarg and passed to MODEL as config=.",
)
@click.option(
    "--config-kwarg",
    "config_kwargs",
    multiple=True,
    metavar="NAME=VALUE",
    help="An argument of --config's class (repeatable).",
)
@click.option("--name", default=None, help="The result's name  [default: the model's class's name]")
@RUN_OPTIONS
def custom(
    model: str,
    input_shapes: Tuple[str, ...],
    input_dtypes: Tuple[str, ...],
    int_high: Optional[int],
    input_factory: Optional[str],
    randomness: str,
    train: bool,
    kwargs: Tuple[str, ...],
    config: Optional[str],
    config_kwargs: Tuple[str, ...],
    name: Optional[str],
    **given: Any,
) -> None:
    """Benchmark N copies of your own model, MODEL (MODULE:CLASS, or MODULE:FUNCTION returning a new
    nn.Module), made wide by vmap and by surgery.

    \b
    Examples:
      wide_tessera custom my_pkg.models:Expert --input-shape 32,256 --n-values 1,4,16 --kwarg d=256
      wide_tessera custom my_pkg.models:make_layer --input-shape 32,256 --n-values 1,4,16
      wide_tessera custom transformers.models.llama.modeling_llama:LlamaMLP --config transformers:LlamaConfig
        --config-kwarg hidden_size=64 --config-kwarg intermediate_size=128 --input-shape 8,64 --n-values 4
      wide_tessera custom my_models:TwoTower --input-shape 8,64 --input-shape 8,32 --n-values 2,8 -o towers.json
      wide_tessera custom my_models:Tagger --input-shape 4,16 --input-dtype int64 --int-high 1000 --n-values 4
    """

    def jobs(settings: RunSettings, texts: Dict[str, List[str]]) -> List[BenchmarkJob]:
        if "n_values" not in texts and settings.search is None:
            raise WideTesseraError("give the N values to try with --n-values N1,N2,... (or --search LO:HI)")
        if settings.search is not None:
            texts = {**texts, "n_values": [str(n) for n in search_candidates(settings.search)]}
        if bool(input_shapes) == bool(input_factory):
            raise WideTesseraError(
                "give --input-shape D1,D2,... (repeat for several inputs) or --input-factory, not both"
            )
        shapes = [parse_shape(text) for text in input_shapes]
        overrides = SweepParams.of([1], dtype=["float32"]).parse_overrides(texts)  # custom runs sweep dtype only
        job = build_custom_job(
            load_object(model, "MODEL", "an nn.Module class or a function returning one"),
            (shapes if len(shapes) > 1 else shapes[0]) if shapes else None,
            overrides.pop("n_values"),
            name,
            overrides.pop("dtype", ["float32"]),
            model_kwargs(kwargs, config, config_kwargs),
            settings,
            input_dtype=list(input_dtypes) or None,
            int_high=int_high,
            input_factory=load_object(input_factory, "--input-factory", "a function") if input_factory else None,
            randomness=randomness,
            train=train or settings.mode in TRAINING_MODES,
        )
        return [job]

    _measure(jobs, "custom", command="custom", **given)


custom.help += _EXIT_STATUS


@click.command()
@click.argument("names", nargs=-1)
@click.option("--preset", default="quick", show_default=True, help="Sweep preset: ci, quick or full.")
@click.option(
    "-o",
    "--output",
    "table",
    default=None,
    metavar="TABLE",
    help=f"The dispatch table to write, or merge into.  [default: ${TABLE_ENV}, else dispatch.json in the "
    "per-user cache: ~/.cache/wide_tessera]",
)
@click.option(
    "--results", default=None, metavar="FILE", help="Also write every result to this JSON file, as benchmark -o does."
)
@options(IMPORT, DEVICE, SELECTION, SAMPLING, QUIET, NO_SAVE)
def tune(names: Tuple[str, ...], preset: str, table: Optional[str], results: Optional[str], **given: Any) -> None:
    """Measure ops (all of them when none is named) and write their verdicts to the dispatch
    table that wide_tessera.fuse() reads.

    Every point is measured twice, independently (--confirm all): only a significant win
    that the second measurement confirms enters the table as `fuse`. Controls are not
    timed (they never win). An existing table keeps its other entries; a newer measurement
    of the same op, device, dtype, mode and parameters replaces the older one.

    \b
    Examples:
      wide_tessera tune gemm mlp --preset ci
      wide_tessera tune moe_experts --set d_model=256 --set hidden=1024 --n-values 1,4,16,64 -o moe.json
      wide_tessera tune --preset quick --mode train_step
    """

    def jobs(settings: RunSettings, texts: Dict[str, List[str]]) -> List[BenchmarkJob]:
        return build_jobs(names or op_names(), preset, settings.device, texts, not given["quiet"], not names)

    if table is None:  # the per-user cache file, its folder made on first use
        table = str(default_table_path())
        with usage_errors():
            make_folder(Path(table).parent, "dispatch table folder")
    _measure(
        jobs,
        preset,
        output=results,
        resume=False,
        target_ci=TimingConfig.target_rel_ci,
        confirm="all",
        controls=False,
        roofline=False,
        energy=False,
        dump_ir=None,
        strict=False,
        save_dispatch=table,
        overwrite=results is not None,  # --results rewrites its results: the table is what tune keeps
        output_option="--results",
        command="tune",
        **given,
    )


tune.help += """
    Exit status: 0 when every strategy ran and was correct (the table is written either
    way); 1 when any was incorrect, failed, timed out or crashed; 2 for bad input; 4 when
    --results FILE could not be written with the latest points; 130
    when interrupted (the ops finished before it are in the table).
"""


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


_CPU_CLOCK = "timed by its CPU clock, which their load does not stretch"


class _LoadWatch:
    """What other processes leave this CPU run, probed before it measures and between ops.

    With --threads auto the run takes the cores free when it starts; with no --threads, torch's
    choice, unless the machine is too busy for it: then it takes the free cores too, and where
    none is free, one thread, which the timer times by its CPU clock (timing.cpu_clock). Beside
    two busy loops on the 2-core machine, torch's two threads had 16 of 18 ops of the quick
    preset stopped after two DISTURBED points, every round waiting for a time slice. A
    --threads K the user gave is kept, and a machine too busy for it is named once, with what
    would measure it. The threads stay as the run began: every op's confirmation comes after
    all first passes, and a count changed between ops measured an op's passes with different
    threads (and recorded only the last)."""

    def __init__(self, threads: Union[None, int, str], timing: TimingConfig):
        self.adapt, self.asked, self.warned = threads is None or threads == "auto", threads == "auto", False
        self.timing = timing
        self.since: Optional[HealthMonitor] = None  # started at the last check: the load over the op since

    def check(self) -> Optional[str]:
        other, threads = probe_load(self.since), torch.get_num_threads()
        self.since = HealthMonitor("cpu")
        free, cores = free_cores(other), len(usable_cpus())
        seen = f"other processes use {other:.1f} of {cores} cores"
        if self.adapt:  # the first check
            self.adapt = False
            if not self.asked and threads <= free:
                return None
            self.warned = True
            torch.set_num_threads(max(1, free))
            cpu = cpu_clock("cpu", self.timing)
            clock = f", {_CPU_CLOCK}" if cpu else ""
            said = f"--threads auto: {seen}" if self.asked else f"busy machine: {seen}, too busy for torch's {threads}"
            return f"{said}: measuring with {max(1, free)} thread(s){clock}"
        if threads <= free or self.warned:
            return None
        self.warned = True
        if cpu_clock("cpu", self.timing):
            return f"busy machine: {seen}: this run's one thread is {_CPU_CLOCK}"
        return (
            f"busy machine: {seen}, and this run's {threads} threads need {threads} free: its points will wait "
            f"for time slices and read DISTURBED; {load_remedy(other)}"
        )


def _measure(
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
            if shard is not None:  # under torchrun: this rank's device, threads and share of the points
                shard.join(settings.device)
                held.callback(shard.leave)
                settings = dataclasses.replace(settings, device=rank_device(settings.device))
                torch.set_num_threads(rank_threads() if auto or threads is None else int(threads))
            elif threads is not None and not auto:
                torch.set_num_threads(int(threads))
            jobs = make_jobs(settings, texts)
            for job in jobs:
                check_runnable(job, settings)
            _check_trace_n(jobs, settings)
            # after the input is checked (a bad value is the one line said), before --resume
            # compares the threads of what it keeps, which the load may set here
            load = _LoadWatch(threads, settings.timing) if shard is None and settings.device == "cpu" else None
            said = load.check() if load is not None else None
            if said:
                click.echo(said, err=True)
            writer = shard is None or shard.rank == 0  # rank 0 writes the results file and the table
            if output and writer:
                held.enter_context(results_lock(output))  # until the last save: one writer per file
            if save_dispatch is not None and writer:  # locked by each merge, not the run: first calls write it too
                check_table_target(save_dispatch, output)
            previous = previous_results(output, settings, shard is not None) if resume else {}
        kept_as = _run_file(command, jobs, preset) if writer and not no_save else None
        given_output = output
        run_file = kept_as
        if output is None and kept_as is not None:  # the run file (a name no other run takes) is the results file
            output, kept_as = kept_as, None
        # --dump-ir: clock every Triton compilation of the run (nothing without triton)
        clock = held.enter_context(CompileClock()) if dump_ir and triton_unavailable_reason("cuda") is None else None

        in_table: List[str] = []  # the ops merged into the dispatch table so far

        def finished(result: BenchmarkResult, progress: Progress) -> None:
            progress.echo(result.brief() + "\n")  # each op's answer as soon as it is done
            said = load.check() if load is not None else None  # before the next op
            if said:
                progress.echo(said + "\n")
            try:
                merged = merge_into(save_dispatch, result) if save_dispatch is not None else None
            except WideTesseraError as e:  # the table changed under the run: the answer above stands
                merged = f"dispatch table {save_dispatch}: {result.op} not merged: {e}"
            else:
                in_table.extend([result.op] if merged and result.complete else [])
            if merged:
                progress.echo(merged + "\n")

        # What fails only mid-run (a folder changed or vanished under the run) is one line too,
        # as bad input is; the points measured by then are in the results file (saved after each).
        with usage_errors():
            try:
                if shard is None:
                    progress = held.enter_context(
                        closing(Progress(points_to_measure(jobs, settings, previous), enabled=not quiet))
                    )
                    kept, results, unsaved = measure_jobs(
                        jobs, settings, previous, output, progress, lambda r: finished(r, progress)
                    )
                    errors: List[str] = []
                else:  # each rank's lines labelled, and no bar: K bars on one terminal overwrite each other
                    progress = held.enter_context(
                        closing(Progress(0, enabled=not quiet, label=f"[rank {shard.rank}] "))
                    )
                    gathered = measure_shard(jobs, settings, previous, output, progress, shard)
                    if gathered is None:  # not rank 0: rank 0 reports, and says how the run ends
                        raise SystemExit(shard.broadcast(None))
                    kept, results, errors = gathered
                    unsaved = []  # rank 0 wrote the joined file above, or raised
                    for result in results:
                        finished(result, progress)
            except Interrupted as stop:
                ops = ", ".join(in_table) or "no op had finished"
                table = f"; in the dispatch table {save_dispatch}: {ops}" if save_dispatch else ""
                said = f"\ninterrupted: {stop}{table}" if stop.output else f"\ninterrupted ({stop}){table}"
                click.echo(said + _how_to_continue(command, stop.output, given_output, jobs, in_table), err=True)
                raise SystemExit(130) from None
        if len(results) > 1:
            click.echo(closing_table(results))
        if run_file is not None:
            note = _against_previous_run(results, [run_file, given_output])
            if note is not None:
                click.echo(note)
        if kept_as is not None:  # -o FILE was written; the runs folder keeps the run too
            try:
                save_results([*kept, *results], kept_as)
            except WideTesseraError as e:
                click.echo(f"{e}: this run is kept in {output} only", err=True)
        code = _report(results, kept, output, unsaved, dump_ir, strict, errors, clock)
        if shard is not None:
            shard.broadcast(code)
        if code:
            raise SystemExit(code)


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
