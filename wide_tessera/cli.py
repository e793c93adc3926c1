"""The `wide_tessera` command: list ops, run benchmarks, show saved results."""

from __future__ import annotations

import ast
import csv
import dataclasses
import json
import os
import re
import signal
import sys
from contextlib import ExitStack, closing
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import click
import torch

from .api import build_custom_job, build_job, resolve_device
from .reports import markdown, tidy
from .core.job import group_key
from .core.capabilities import unmet_need
from .collectives.cases import COLLECTIVES, CollectivesRun, is_collectives_file, load_collectives, sizes
from .collectives.cases import rows as collective_rows
from .reports.compare import compare, render
from .dispatch.table import TABLE_ENV, DispatchTable, default_table_path, entries_of
from .core.environment import capture_environment
from .core.files import results_lock, results_target
from .core.job import DTYPES, BenchmarkJob, SweepParams
from .measurement.modes import MODES, TRAINING_MODES
from .measurement.controls import COMPILE_MODES
from .core.job import point_keys
from .sweep.point import CONFIRM_MODES, PRESET_RUNS, default_timing
from .ops.registry import REGISTRY, get_op, import_ops, op_names, outside_strategies
from .reports.text import format_table, n_or_never
from .collectives.plots import plot_collectives
from .reports.plots import plot_result
from .sweep.progress import Progress
from .reports.page import write_report
from .sweep.resume import check_resumable, point_order, points_left
from .sweep.runner import RunInterrupted, RunSettings, check_runnable, run_job
from .results.load import load_results
from .results.schema import BenchmarkResult, save_results
from .sweep.shards import Shard, assign, joined, leftover_shards, mark, rank_device, rank_threads, remove_shards, shard_path, with_shards  # fmt: skip
from .measurement.stages import StageTimeouts
from .measurement.timing import TimingConfig
from .kernels.facts import CompileClock, dump_ir as write_ir
from .core.user_input import check_number, check_seed
from .core.errors import WideTesseraError, unknown
from .collectives.torchrun import run_collectives, summary
from .kernels import autotuned_kernels, triton_unavailable_reason
from .widen.custom import INPUT_DTYPES, RANDOMNESS

__all__ = ["cli", "main"]


def parse_override(text: str) -> Tuple[str, List[str]]:
    """'channels=32,64' -> ('channels', ['32', '64']); the op's sweep reads each value as its axis's kind."""
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise WideTesseraError(f"--set {text!r}: expected AXIS=V1,V2,... (e.g. channels=32,64)")
    return key.strip(), values.split(",")


def _override_texts(sets: Tuple[str, ...], n_values: Optional[str]) -> Dict[str, List[str]]:
    """--set and --n-values as text by axis; an axis given twice would silently lose one of them."""
    texts: Dict[str, List[str]] = {}
    for key, values in map(parse_override, sets):
        if key == "n_values":
            raise WideTesseraError(f"--set n_values=...: give N values with --n-values {','.join(values)}")
        if key in texts:
            raise WideTesseraError(f"--set {key} is given twice; give all its values in one: --set {key}=V1,V2")
        texts[key] = values
    if n_values is not None:
        texts["n_values"] = n_values.split(",")
    return texts


def _build_jobs(
    names: Sequence[str], preset: str, device: str, texts: Dict[str, List[str]], verbose: bool
) -> List[BenchmarkJob]:
    """One job per op (an op named twice, or by an alias too, runs once), its overrides read by its own axes."""
    ops = dict.fromkeys(get_op(name).NAME for name in names)
    return [
        build_job(op, preset, device, get_op(op).benchmark_job(preset).sweep.parse_overrides(texts), verbose)
        for op in ops
    ]


def _check_output(path: Optional[str], resume: bool) -> None:
    if path is None:
        if resume:
            raise WideTesseraError("--resume needs -o FILE: the results file to continue")
        return
    try:
        results_target(path)
    except WideTesseraError as e:
        raise WideTesseraError(f"-o {e}") from None
    if resume and not Path(path).exists() and not leftover_shards(path):
        raise WideTesseraError(f"--resume: {path} does not exist; run without --resume to start it")


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gb": 2**30,
    "gib": 2**30,
}


def parse_size(text: str, option: str = "--memory-budget") -> int:
    """'512MiB', '2GB', '1.5g', '1048576' -> bytes (K, M, G are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise WideTesseraError(f"{option} {text!r}: expected a positive size such as 512MiB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _previous_results(path: str, preset: str, settings: RunSettings, sharded: bool = False) -> Dict[str, BenchmarkResult]:
    """Every result in the file a --resume continues, and in the shard files a sharded run left
    beside it (a rank died), by op, each checked to be measured as this run measures."""
    results = load_results(path) if Path(path).exists() else []
    previous = {r.op: r for r in results}
    if len(previous) < len(results):
        raise WideTesseraError(f"--resume: {path} holds more than one result for an op; it was not written by one run")
    previous = with_shards(previous, path)
    environment = capture_environment(settings.device)
    if sharded:  # ranks run on cuda:0, cuda:1, ...; the file says cuda
        environment = dataclasses.replace(environment, device=environment.device.split(":")[0])
    for r in previous.values():
        check_resumable(
            r, path, preset, settings.seed, settings.timing, environment, settings.compile, settings.mode, settings.energy
        )
    return previous


# Names in the settings' own errors -> the options that set them.
_OPTIONS = {
    "seed": "--seed",
    "threads": "--threads",
    "budget_s": "--budget",
    "target_rel_ci": "--target-ci",
    "multiplier": "--timeout-multiplier",
}


def _run_settings(
    device: Optional[str],
    seed: int,
    threads: Optional[int],
    target_ci: float,
    budget: Optional[float],
    cuda_graph: bool,
    timeout_multiplier: float,
    memory_budget: Optional[str],
    isolate: bool = False,
    confirm: Optional[str] = None,
    compile_mode: str = "none",
    controls: Optional[bool] = None,
    roofline: bool = False,
    mode: str = "inference",
    preset: Optional[str] = None,
    energy: bool = False,
) -> RunSettings:
    """The run's settings from the options, each checked; an error names the option, not the field."""
    resolved = resolve_device(device)
    if cuda_graph and not resolved.startswith("cuda"):
        raise WideTesseraError(f"--cuda-graph needs a CUDA device; the run is on {resolved}")
    try:
        if threads is not None:
            check_number("threads", threads, 1, 4096, integer=True, low_ok=True)
        return RunSettings(
            resolved,
            check_seed(seed),
            TimingConfig(
                target_rel_ci=target_ci,
                budget_s=default_timing(preset).budget_s if budget is None else budget,
                cuda_graph=cuda_graph,
            ),
            StageTimeouts(multiplier=timeout_multiplier),
            None if memory_budget is None else parse_size(memory_budget),
            isolate,
            confirm,
            compile=compile_mode,
            controls=controls,
            roofline=roofline,
            mode=mode,
            preset=preset,
            energy=energy,
        )
    except WideTesseraError as e:
        field, sep, rest = str(e).partition("=")
        raise WideTesseraError(f"{_OPTIONS[field]} {rest}" if sep and field in _OPTIONS else str(e)) from None


def _options(*options: Callable) -> Callable:
    """Apply click options in the order listed (click's decorators apply bottom-up)."""

    def decorate(f: Callable) -> Callable:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


_IMPORT = click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="Import MODULE first: its @register ops and register_strategy strategies join the run (repeatable).",
)

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="wide_tessera")
def cli() -> None:
    """When does fusing N copies of an op beat N separate calls, and which strategy wins?"""


@cli.command("list")
@_IMPORT
@click.option("--device", default=None, help="Count the points a run will have on this device  [default: cuda if available, else cpu]")
def list_ops(imports: Tuple[str, ...], device: Optional[str]) -> None:
    """Every op with its strategies, presets and sweep axes, and what a run on this device will measure."""
    try:
        import_ops(imports)
        names = op_names()
        device = resolve_device(device)
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None
    for name in names:
        cls = REGISTRY[name]
        aliases = [k for k, v in REGISTRY.items() if v is cls and k != name]
        click.echo(f"{name}" + (f" (alias: {', '.join(aliases)})" if aliases else "") + f"  [{cls.__name__}]")
        outside = [f"{s} (outside)" for s in outside_strategies(cls)]
        click.echo(f"  strategies: baseline, {', '.join([*cls.BENCHMARK_STRATEGIES, *outside])}")
        rows, skipped = [], {}
        for preset, sweep in cls.BENCHMARK_SWEEPS.items():
            here, why = _points_here(name, preset, device)
            skipped.update(why)
            rows.append(
                [
                    preset,
                    ",".join(map(str, sweep.n_values)),
                    str(sweep.n_points()),
                    str(here),
                    " ".join(f"{k}={','.join(map(str, v))}" for k, v in sweep.axes.items()),
                ]
            )
        click.echo("  " + format_table(["preset", "n_values", "points", f"on {device}", "axes"], rows).replace("\n", "\n  "))
        for strategy, reason in skipped.items():
            click.echo(f"  on {device}, {strategy} is skipped: {reason}")


def _points_here(op: str, preset: str, device: str) -> Tuple[int, Dict[str, str]]:
    """The points a run of `preset` measures on `device` (presets leave out dtypes the device lacks
    or emulates), and the strategies skipped at every one of them, with the reason."""
    try:
        job = build_job(op, preset, device, {}, verbose=False)
    except WideTesseraError:  # no dtype of the preset runs here
        return 0, {}
    points = job.sweep.points()
    skipped = {}
    for strategy in job.strategies:
        reasons = [
            unmet_need(job.strategy_needs.get(strategy), device, DTYPES[params.get("dtype", "float32")], params)
            for _, params in points
        ]
        if points and all(reasons):
            skipped[strategy] = reasons[0]
    return len(points), skipped


# Options of every command that measures (`benchmark`, `custom`, `tune`).
_DEVICE = click.option("--device", default=None, help="cpu, cuda or cuda:N  [default: cuda if available, else cpu]")
_N_VALUES = click.option("--n-values", default=None, metavar="N1,N2,...", help="Replace the preset's N values.")
_SET = click.option("--set", "sets", multiple=True, metavar="AXIS=V1,V2", help="Replace a sweep axis (repeatable).")
_SEED = click.option("--seed", default=0, show_default=True, help="Seed for models and inputs.")
_THREADS = click.option("--threads", type=int, default=None, help="CPU threads for torch  [default: torch's choice]")
_BUDGET = click.option(
    "--budget",
    type=float,
    default=None,
    help=f"Sampling seconds per function.  [default: {TimingConfig.budget_s}; preset quick: "
    f"{PRESET_RUNS['quick'].budget_s}, ci: {PRESET_RUNS['ci'].budget_s}]",
)
_CUDA_GRAPH = click.option("--cuda-graph", is_flag=True, help="CUDA only: time CUDA-graph replays, without launch overhead.")
_ISOLATE = click.option("--isolate", is_flag=True, help="Run each op in a worker process: a hang or crash costs one strategy.")
_TIMEOUT_MULTIPLIER = click.option(
    "--timeout-multiplier", type=float, default=1.0, show_default=True, help="Scale every stage's time limit."
)
_MEMORY_BUDGET = click.option("--memory-budget", default=None, metavar="SIZE", help="Skip points estimated above SIZE (e.g. 4GiB).")
_MODE = click.option(
    "--mode",
    type=click.Choice(MODES),
    default="inference",
    show_default=True,
    help="What is timed: inference (no autograd), forward (recording), backward, forward_backward, train_step "
    "(forward, backward, SGD step). Training modes also check gradients and updated parameters.",
)
_COMPILE = click.option(
    "--compile",
    "compile_mode",
    type=click.Choice(COMPILE_MODES),
    default="none",
    show_default=True,
    help="torch.compile the baseline and every strategy alike; the compiled callables are checked and timed.",
)
_QUIET = click.option("--quiet", is_flag=True, help="No progress on stderr.")

# The options of `benchmark` and `custom`.
_RUN_OPTIONS = _options(
    _IMPORT,
    _DEVICE,
    click.option("-o", "--output", default=None, help="Write every result to this JSON file, after every point."),
    click.option("--resume", is_flag=True, help="Continue the incomplete results in -o FILE, skipping measured points."),
    _N_VALUES,
    _SET,
    _SEED,
    _THREADS,
    click.option(
        "--target-ci",
        type=float,
        default=TimingConfig.target_rel_ci,
        show_default=True,
        help="Sample until each median's 95% CI is narrower than this fraction of it.",
    ),
    _BUDGET,
    _CUDA_GRAPH,
    _ISOLATE,
    _TIMEOUT_MULTIPLIER,
    _MEMORY_BUDGET,
    click.option(
        "--confirm",
        type=click.Choice(CONFIRM_MODES),
        default=None,
        help="Which points to measure again, independently, after the sweep; disagreeing points are unstable.  "
        "[default: deciding; preset ci: none]",
    ),
    _MODE,
    _COMPILE,
    click.option(
        "--controls/--no-controls",
        default=None,
        help="Also time the baseline loop in one CUDA graph (CUDA) and compiled, and in train_step stepped by "
        "one foreach or fused optimizer: cheaper loops that do not fuse.  "
        "[default: controls; preset ci: no-controls]",
    ),
    click.option(
        "--roofline",
        is_flag=True,
        help="Measure the device's peaks (cached) and show timings against the roofline bound.",
    ),
    click.option(
        "--energy",
        is_flag=True,
        help="Also measure each callable's energy per call and power from NVML's counter (CUDA): "
        "3 windows of at least 1 s each, per callable and point.",
    ),
    click.option(
        "--dump-ir",
        default=None,
        metavar="DIR",
        help="After the run, write each Triton kernel's TTIR, TTGIR, LLIR, PTX and facts (compile times, registers, autotuning) to DIR.",
    ),
    click.option("--strict", is_flag=True, help="Exit 3 when a result is UNRELIABLE (busy machine, unstable points...)."),
    _QUIET,
    click.option(
        "--save-dispatch",
        default=None,
        metavar="TABLE",
        help="Merge each op's verdicts into this dispatch table (see `tune`); only confirmed wins enter it as fuse.",
    ),
)

_EXIT_STATUS = """
    Exit status: 0 when every strategy ran and was correct; 1 when any was incorrect,
    failed, timed out or crashed; 2 for bad input; 3 with --strict when a result is
    unreliable; 130 when interrupted (what was measured is saved, marked incomplete).
"""


@cli.command()
@click.argument("names", nargs=-1)
@click.option("--all", "run_all", is_flag=True, help="Benchmark every registered op.")
@click.option("--preset", default="full", show_default=True, help="Sweep preset: ci, quick or full.")
@_RUN_OPTIONS
def benchmark(names: Tuple[str, ...], run_all: bool, preset: str, **options: Any) -> None:
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
        return _build_jobs(op_names() if run_all else names, preset, settings.device, texts, not options["quiet"])

    _measure(jobs, preset, **options)


benchmark.help += _EXIT_STATUS


@cli.command()
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
@click.option("--int-high", type=int, default=None, help="Exclusive bound of integer inputs' values (e.g. a vocabulary size).")
@click.option(
    "--input-factory",
    default=None,
    metavar="MODULE:FUNCTION",
    help="A function of no arguments returning one model's input (a tensor or a tuple), instead of --input-shape.",
)
@click.option(
    "--randomness",
    type=click.Choice(RANDOMNESS),
    default="error",
    show_default=True,
    help="vmap's randomness, for models that draw random numbers (dropout in train mode).",
)
@click.option(
    "--train", is_flag=True, help="Run the models in train mode (dropout active) in --mode inference too (without autograd)."
)
@click.option("--kwarg", "kwargs", multiple=True, metavar="NAME=VALUE", help="An argument of the class (repeatable).")
@click.option("--name", default=None, help="The result's name  [default: the class's name]")
@_RUN_OPTIONS
def custom(
    model: str,
    input_shapes: Tuple[str, ...],
    input_dtypes: Tuple[str, ...],
    int_high: Optional[int],
    input_factory: Optional[str],
    randomness: str,
    train: bool,
    kwargs: Tuple[str, ...],
    name: Optional[str],
    **options: Any,
) -> None:
    """Benchmark N copies of your own nn.Module class, MODULE:CLASS, made wide by vmap and by surgery.

    \b
    Examples:
      wide_tessera custom my_pkg.models:Expert --input-shape 32,256 --n-values 1,4,16 --kwarg d=256
      wide_tessera custom my_models:TwoTower --input-shape 8,64 --input-shape 8,32 --n-values 2,8 -o towers.json
      wide_tessera custom my_models:Tagger --input-shape 4,16 --input-dtype int64 --int-high 1000 --n-values 4
    """

    def jobs(settings: RunSettings, texts: Dict[str, List[str]]) -> List[BenchmarkJob]:
        if "n_values" not in texts:
            raise WideTesseraError("give the N values to try with --n-values N1,N2,...")
        if bool(input_shapes) == bool(input_factory):
            raise WideTesseraError("give --input-shape D1,D2,... (repeat for several inputs) or --input-factory, not both")
        shapes = [_parse_shape(text) for text in input_shapes]
        overrides = SweepParams.of([1], dtype=["float32"]).parse_overrides(texts)  # custom runs sweep dtype only
        job = build_custom_job(
            load_object(model, "MODEL", "an nn.Module class"),
            (shapes if len(shapes) > 1 else shapes[0]) if shapes else None,
            overrides.pop("n_values"),
            name,
            overrides.pop("dtype", ["float32"]),
            dict(map(_parse_kwarg, kwargs)),
            settings.isolate,
            settings.timeouts,
            input_dtype=list(input_dtypes) or None,
            int_high=int_high,
            input_factory=load_object(input_factory, "--input-factory", "a function") if input_factory else None,
            randomness=randomness,
            train=train or settings.mode in TRAINING_MODES,
        )
        return [job]

    _measure(jobs, "custom", **options)


custom.help += _EXIT_STATUS


@cli.command()
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
@click.option("--results", default=None, metavar="FILE", help="Also write every result to this JSON file, as benchmark -o does.")
@_options(_IMPORT, _DEVICE, _N_VALUES, _SET, _SEED, _THREADS, _BUDGET, _CUDA_GRAPH, _ISOLATE, _TIMEOUT_MULTIPLIER)
@_options(_MEMORY_BUDGET, _MODE, _COMPILE, _QUIET)
def tune(names: Tuple[str, ...], preset: str, table: Optional[str], results: Optional[str], **options: Any) -> None:
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
        return _build_jobs(names or op_names(), preset, settings.device, texts, not options["quiet"])

    if table is None:  # the per-user cache file, its folder made on first use
        table = str(default_table_path())
        Path(table).parent.mkdir(parents=True, exist_ok=True)

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
        **options,
    )


tune.help += """
    Exit status: 0 when every strategy ran and was correct (the table is written either
    way); 1 when any was incorrect, failed, timed out or crashed; 2 for bad input; 130
    when interrupted (the ops finished before it are in the table).
"""


def _parse_shape(text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise WideTesseraError(f"--input-shape {text!r}: expected positive ints separated by commas, e.g. 32,256") from None


def _parse_kwarg(text: str) -> Tuple[str, Any]:
    """'d=256' -> ('d', 256): a Python literal where the value reads as one (256, 0.1, True, (3, 3)), else the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise WideTesseraError(f"--kwarg {text!r}: expected NAME=VALUE, e.g. hidden=512")
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value


def load_object(spec: str, option: str, what: str) -> Any:
    """'my_pkg.models:Expert' -> the object, imported (from the current directory too)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise WideTesseraError(f"{option} {spec!r}: expected MODULE:NAME, e.g. my_pkg.models:Expert")
    import_ops([module])
    obj = sys.modules[module]
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise WideTesseraError(f"{option} {spec!r}: {module} has no {attr!r} ({what})")
        obj = getattr(obj, part)
    return obj


def _measure(
    make_jobs: Callable[[RunSettings, Dict[str, List[str]]], List[BenchmarkJob]],
    preset: str,
    imports: Tuple[str, ...],
    device: Optional[str],
    output: Optional[str],
    resume: bool,
    n_values: Optional[str],
    sets: Tuple[str, ...],
    seed: int,
    threads: Optional[int],
    target_ci: float,
    budget: Optional[float],
    cuda_graph: bool,
    isolate: bool,
    timeout_multiplier: float,
    memory_budget: Optional[str],
    confirm: Optional[str],
    mode: str,
    compile_mode: str,
    controls: Optional[bool],
    roofline: bool,
    energy: bool,
    dump_ir: Optional[str],
    strict: bool,
    quiet: bool,
    save_dispatch: Optional[str],
) -> None:
    """Check every option, build the jobs, measure them, saving as it goes; exit with the run's status."""
    with ExitStack() as held:
        try:
            import_ops(imports)
            texts = _override_texts(sets, n_values)
            _check_output(output, resume)
            if dump_ir:
                _check_directory(dump_ir)
            settings = _run_settings(
                device,
                seed,
                threads,
                target_ci,
                budget,
                cuda_graph,
                timeout_multiplier,
                memory_budget,
                isolate,
                confirm,
                compile_mode,
                controls,
                roofline,
                mode,
                preset,
                energy,
            )
            shard = Shard.from_environment()
            if shard is not None:  # under torchrun: this rank's device, threads and share of the points
                shard.join(settings.device)
                held.callback(shard.leave)
                settings = dataclasses.replace(settings, device=rank_device(settings.device))
                torch.set_num_threads(threads or rank_threads())
            elif threads is not None:
                torch.set_num_threads(threads)
            jobs = make_jobs(settings, texts)
            for job in jobs:
                check_runnable(job, settings)
            writer = shard is None or shard.rank == 0  # rank 0 writes the results file and the table
            if output and writer:
                held.enter_context(results_lock(output))  # until the last save: one writer per file
            if save_dispatch and writer:
                _check_table(save_dispatch, output)
                held.enter_context(results_lock(save_dispatch))
            previous = _previous_results(output, preset, settings, shard is not None) if resume else {}
        except WideTesseraError as e:
            raise click.UsageError(str(e)) from None
        kept = [r for op, r in previous.items() if op not in {job.op for job in jobs}]  # other ops in the file
        # --dump-ir: clock every Triton compilation of the run (nothing without triton)
        clock = held.enter_context(CompileClock()) if dump_ir and triton_unavailable_reason("cuda") is None else None

        if shard is None:
            todo = sum(points_left(job.sweep, previous.get(job.op)) for job in jobs)
            progress = held.enter_context(closing(Progress(todo, enabled=not quiet)))
            results: List[BenchmarkResult] = []
            for job in jobs:
                results.append(_run_job(job, settings, previous.get(job.op), [*kept, *results], output, progress))
                _finished(results[-1], save_dispatch, progress)  # each op's summary as soon as it is done
            if output and resume:  # the shards' points are in the file now
                remove_shards(output)
            errors: List[str] = []
        else:
            owner = assign(jobs, shard.ranks, {op: point_keys(r.points) for op, r in previous.items()})
            todo = sum(1 for job in jobs for n, p in job.sweep.points() if owner[(job.op, group_key(p))] == shard.rank)
            progress = held.enter_context(closing(Progress(todo, enabled=not quiet, label=f"[rank {shard.rank}] ")))
            gathered = _run_shard(jobs, settings, previous, owner, output, progress, shard)
            if gathered is None:  # not rank 0: rank 0 reports, and says how the run ends
                sys.exit(shard.broadcast(None))
            results, errors = gathered
            for result in results:
                _finished(result, save_dispatch, progress)
        code = _report(results, kept, output, dump_ir, strict, errors, clock)
        if shard is not None:
            shard.broadcast(code)
        if code:
            sys.exit(code)


def _finished(result: BenchmarkResult, save_dispatch: Optional[str], progress: Progress) -> None:
    progress.echo(result.summary() + "\n")
    if save_dispatch:
        _save_dispatch(save_dispatch, result, progress)


def _report(
    results: List[BenchmarkResult],
    kept: List[BenchmarkResult],
    output: Optional[str],
    dump_ir: Optional[str],
    strict: bool,
    errors: List[str],
    clock: Optional[CompileClock],
) -> int:
    """Write the IR, list what failed, and say how the run ends: its exit status."""
    if output:
        click.echo(f"wrote {len(kept) + len(results)} result(s) to {output}", err=True)
    if dump_ir:
        _dump_ir(Path(dump_ir), clock)
    failures = [*errors, *(f"{r.op}: {f}" for r in results for f in r.failures)]
    if failures:
        click.echo(f"{len(failures)} failure(s):\n  " + "\n  ".join(failures), err=True)
        return 1
    unreliable = [f"{r.op}: {'; '.join(r.unreliable_reasons)}" for r in results if not r.reliable]
    if strict and unreliable:
        click.echo(f"--strict: {len(unreliable)} unreliable result(s):\n  " + "\n  ".join(unreliable), err=True)
        return 3
    return 0


def _run_shard(
    jobs: List[BenchmarkJob],
    settings: RunSettings,
    previous: Dict[str, BenchmarkResult],
    owner: Dict[Tuple[str, str], int],
    output: Optional[str],
    progress: Progress,
    shard: Shard,
) -> Optional[Tuple[List[BenchmarkResult], List[str]]]:
    """This rank's groups of every job, saved to its shard file after every point; on rank 0,
    every rank's results joined (and written to `output`) with the errors of ranks that raised;
    None on the other ranks. A rank that raises still hands over what it measured."""
    where = shard.where(settings.device)
    path = str(shard_path(output, shard.rank)) if output else None
    mine: List[BenchmarkResult] = []
    latest: Dict[str, BenchmarkResult] = {}

    def marked(result: BenchmarkResult) -> BenchmarkResult:
        earlier = previous.get(result.op)
        latest[result.op] = mark(result, where, point_keys(earlier.points) if earlier else set())
        return latest[result.op]

    error = None
    try:
        for job in jobs:
            share = partial(_owns, owner, job.op, shard.rank)
            mine.append(_run_job(job, settings, previous.get(job.op), mine, path, progress, share, marked))
    except Exception as e:  # noqa: BLE001  a bug, say: the other ranks' points must not be lost
        error = f"rank {shard.rank}: {type(e).__name__}: {e}"
        mine += [r for op, r in latest.items() if op not in {m.op for m in mine}]
    gathered = shard.gather((mine, error))
    if gathered is None:
        return None
    results = []
    for job in jobs:
        parts = [r for rank_results, _ in gathered for r in rank_results if r.op == job.op]
        earlier = previous[job.op].points if job.op in previous else []
        if parts:
            results.append(joined(job, parts, earlier))
    if output:
        save_results([*[r for op, r in previous.items() if op not in {j.op for j in jobs}], *results], output)
        if not any(e for _, e in gathered):  # the shards are in the file now
            remove_shards(output)
    return results, [e for _, e in gathered if e]


def _owns(owner: Dict[Tuple[str, str], int], op: str, rank: int, params: Dict[str, Any]) -> bool:
    return owner[(op, group_key(params))] == rank


def _check_table(path: str, output: Optional[str]) -> None:
    """The dispatch table a run merges into: a regular file or none yet, not the results file,
    and, where it exists, a table (a damaged one is not overwritten: it may hold other measurements)."""
    try:
        results_target(path)
    except WideTesseraError as e:
        raise WideTesseraError(f"dispatch table {e}") from None
    if output and Path(output).resolve() == Path(path).resolve():
        raise WideTesseraError(f"dispatch table {path}: is the results file too; give another file")
    if Path(path).exists():
        DispatchTable.load(path)


def _save_dispatch(path: str, result: BenchmarkResult, progress: Progress) -> None:
    """Merge `result`'s entries into the table at `path`; an interrupted op's are left out."""
    if not result.complete:
        return
    entries = entries_of(result)
    table = DispatchTable.load(path) if Path(path).exists() else DispatchTable()
    table.merged(entries).save(path)
    fused = [n_or_never(e.crossover_n) for e in entries]
    unconfirmed = sum(v.verdict == "unconfirmed" for e in entries for v in e.verdicts)
    note = f"; {unconfirmed} win(s) not confirmed, kept out (tune confirms every point)" if unconfirmed else ""
    count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
    progress.echo(f"dispatch table {path}: {result.op}: {count}, fuse from N = {', '.join(fused)}{note}\n")


def _dump_ir(directory: Path, clock: Optional[CompileClock]) -> None:
    if triton_unavailable_reason("cuda") is not None:  # no triton at all
        click.echo(f"--dump-ir: nothing written: the Triton kernels {triton_unavailable_reason('cuda')}", err=True)
        return
    written = write_ir(autotuned_kernels(), directory, clock)
    click.echo(f"--dump-ir: wrote {len(written)} file(s) to {directory}", err=True)


def _run_job(
    job: BenchmarkJob,
    settings: RunSettings,
    previous: Optional[BenchmarkResult],
    done: List[BenchmarkResult],
    output: Optional[str],
    progress: Progress,
    share: Optional[Callable[[Dict[str, Any]], bool]] = None,
    finish: Callable[[BenchmarkResult], BenchmarkResult] = lambda result: result,
) -> BenchmarkResult:
    """Measure one job (its `share` of the groups in a sharded run), saving after every point;
    on Ctrl-C save what was measured and exit 130. `finish` completes each result before it
    is saved (a sharded run names the rank that measured each point)."""
    if previous is not None and previous.complete and len(point_order(job.sweep, previous.points)) == len(previous.points):
        return previous  # it holds every point this run asks for

    def save(result: BenchmarkResult) -> None:
        if output:
            save_results([*done, finish(result)], output)

    try:
        result = finish(run_job(job, settings, previous, on_point=save, progress=progress, share=share))
    except RunInterrupted as stop:
        save(stop.result)
        where = f"saved {len(stop.result.points)} point(s) of {job.op} to {output}; continue with --resume"
        click.echo(f"\ninterrupted: {where}" if output else "\ninterrupted (nothing saved: no -o FILE)", err=True)
        sys.exit(130)
    save(result)
    return result


@cli.command()
@click.option("--ops", default=",".join(COLLECTIVES), show_default=True, help="Collectives to run, comma-separated.")
@click.option("--min-bytes", default="1KiB", show_default=True, help="Smallest message (nccl-tests' S; powers of two up).")
@click.option("--max-bytes", default="4MiB", show_default=True, help="Largest message.")
@click.option("--dtype", "dtypes", default="float32", show_default=True, help="Dtypes, comma-separated.")
@click.option(
    "--placement",
    "placements",
    default="in_place,out_of_place",
    show_default=True,
    help="in_place, out_of_place, or both (each collective runs those torch.distributed has).",
)
@click.option("--budget", type=float, default=0.2, show_default=True, help="Sampling seconds per case.")
@click.option("--device", default=None, help="cpu (gloo) or cuda (nccl, cuda:LOCAL_RANK)  [default: cuda if available]")
@click.option("-o", "--output", default=None, metavar="FILE", help="Write every result to this JSON file (rank 0).")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def collectives(
    ops: str, min_bytes: str, max_bytes: str, dtypes: str, placements: str, budget: float, device: Optional[str],
    output: Optional[str], quiet: bool,
) -> None:
    """Benchmark the collectives under torchrun: all_reduce, all_gather, reduce_scatter,
    all_to_all and broadcast over message sizes, each result checked, with nccl-tests'
    algbw and busbw (GB/s). gloo on the CPU, nccl on GPUs.

    \b
    Examples:
      torchrun --standalone --nproc-per-node 2 -m wide_tessera collectives --device cpu
      torchrun --nproc-per-node 8 -m wide_tessera collectives --max-bytes 1GiB --dtype bfloat16 -o coll.json

    Exit status: 0 when every result was correct; 1 when one was not; 2 for bad input.
    """
    try:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise WideTesseraError(
                "collectives runs under torchrun, one process per rank: "
                "torchrun --standalone --nproc-per-node 2 -m wide_tessera collectives"
            )
        names = _choices(ops, "collective", COLLECTIVES)
        kinds = _choices(dtypes, "dtype", DTYPES)
        where = _choices(placements, "placement", ("in_place", "out_of_place"))
        low, high = parse_size(min_bytes, "--min-bytes"), parse_size(max_bytes, "--max-bytes")
        if low > high:
            raise WideTesseraError(f"--min-bytes {min_bytes} is larger than --max-bytes {max_bytes}")
        config = TimingConfig(budget_s=budget)
        device = rank_device(resolve_device(device))
        if output:
            results_target(output)
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None
    if not run_collectives(names, sizes(low, high), kinds, where, device, config, output, quiet):
        sys.exit(1)


def _choices(text: str, kind: str, valid: Sequence[str]) -> List[str]:
    """'a, b' -> ['a', 'b'], each one of `valid`."""
    chosen = [value.strip() for value in text.split(",")]
    for value in chosen:
        if value not in valid:
            raise unknown(kind, value, valid)
    return chosen


def _load_files(paths: Sequence[str]) -> Tuple[List[CollectivesRun], List[BenchmarkResult]]:
    """The collectives runs and the results of files written by `collectives -o` and `benchmark -o`."""
    collective = [is_collectives_file(p) for p in paths]
    try:
        runs = [load_collectives(p) for p, c in zip(paths, collective) if c]
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None
    return runs, _load_all([p for p, c in zip(paths, collective) if not c])


def _load_all(paths: Sequence[str]) -> List[BenchmarkResult]:
    """Every result of every file, in order; a bad file is a usage error naming it."""
    try:
        return [r for path in paths for r in load_results(path)]
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None


@cli.command()
@click.argument("paths", nargs=-1, required=True, metavar="FILE...")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "markdown", "csv", "json"]),
    default="table",
    show_default=True,
    help="table: the summaries; markdown: for a pull request; csv, json: the tidy rows (one per N, parameters, strategy).",
)
@click.option("--warnings", "all_warnings", is_flag=True, help="List every warning, not only the digest (table format).")
def show(paths: Tuple[str, ...], fmt: str, all_warnings: bool) -> None:
    """Print the results stored in files written by `benchmark -o` (or by `collectives -o`: their table or rows).

    \b
    Examples:
      wide_tessera show results.json
      wide_tessera show gemm.json conv.json --format markdown >> $GITHUB_STEP_SUMMARY
      wide_tessera show results.json --format csv > results.csv   (pd.read_csv reads it)
    """
    runs, results = _load_files(paths)
    if fmt in ("csv", "json") and runs and results:
        raise click.UsageError("--format csv and json print one kind of row: give results files or collectives files, not both")
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


@cli.command("compare")
@click.argument("base", metavar="BASE.json")
@click.argument("new", metavar="NEW.json")
@click.option("--format", "fmt", type=click.Choice(["table", "markdown"]), default="table", show_default=True)
@click.option(
    "--fail-on-regression",
    "fail_percent",
    type=float,
    default=None,
    metavar="PCT",
    help="Exit 1 when a timing is significantly slower by more than PCT percent, a strategy broke, or a crossover moved to a larger N.",
)
def compare_runs(base: str, new: str, fmt: str, fail_percent: Optional[float]) -> None:
    """Compare two results files point by point: changes in time with their 95% CI, and crossovers.

    \b
    Examples:
      wide_tessera compare main.json branch.json
      wide_tessera compare main.json branch.json --fail-on-regression 10 --format markdown > comment.md

    Exit status: 0; 1 with --fail-on-regression when there is a regression; 2 for bad input.
    """
    try:
        if fail_percent is not None:
            check_number("--fail-on-regression", fail_percent, 0, 1e6, low_ok=True)
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None
    comparison = compare(_load_all([base]), _load_all([new]))
    if not comparison.changes:
        raise click.UsageError(f"{base} and {new} share no measured point (same op, parameters and N): nothing to compare")
    click.echo(render(comparison, fmt == "markdown", fail_percent), nl=False)
    if fail_percent is not None and comparison.regressions(fail_percent):
        sys.exit(1)


@cli.command()
@click.argument("paths", nargs=-1, required=True, metavar="FILE...")
@click.option("-o", "--output", required=True, metavar="DIR", help="Directory for the plots (PNG and SVG).")
def plot(paths: Tuple[str, ...], output: str) -> None:
    """Draw each op's parameter groups: speedup, time and memory against N, and speed against memory.

    Needs matplotlib: pip install 'wide_tessera[plot]'.
    """
    runs, results = _load_files(paths)
    try:
        _check_directory(output)
        written = [path for r in results for path in plot_result(r, Path(output))]
        written += [path for run in runs for path in plot_collectives(run, Path(output))]
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {len(written)} file(s) to {output}")


@cli.command()
@click.argument("paths", nargs=-1, required=True, metavar="FILE...")
@click.option("-o", "--output", required=True, metavar="DIR", help="Directory for README.md and its plots.")
def report(paths: Tuple[str, ...], output: str) -> None:
    """Write one Markdown page: the environment, the headline per op, the tables and the plots.

    DIR/README.md renders on GitHub as it is; without matplotlib it has no plots and says so.
    """
    results = _load_all(paths)
    try:
        _check_directory(output)
        page = write_report(results, Path(output), paths)
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {page}")


def _check_directory(path: str) -> None:
    if Path(path).exists() and not Path(path).is_dir():
        raise WideTesseraError(f"-o {path}: exists and is not a directory; give a directory")


def _first_interrupt(signum: int, frame: object) -> None:
    # The first Ctrl-C raises KeyboardInterrupt as usual, and the run saves what it measured.
    signal.signal(signal.SIGINT, _second_interrupt)
    raise KeyboardInterrupt


def _second_interrupt(signum: int, frame: object) -> None:
    # Another Ctrl-C, during that save or the interpreter's shutdown, ends the process at once
    # without a traceback. Saves replace the file atomically, so the file on disk stays whole.
    os.write(sys.stderr.fileno(), b"\ninterrupted again: exiting now\n")
    os._exit(130)


def main() -> None:
    """Run the command; Ctrl-C during start-up or during the run exits 130 without a traceback.

    click turns KeyboardInterrupt into an 'Aborted!' exit 1, so its own handling is
    bypassed (standalone_mode=False) and redone here.
    """
    signal.signal(signal.SIGINT, _first_interrupt)
    try:
        code = cli.main(prog_name="wide_tessera", standalone_mode=False)
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    except (click.Abort, KeyboardInterrupt):
        click.echo("\ninterrupted", err=True)
        code = 130
    finally:
        # Nothing is left to interrupt. At shutdown Python puts back the default for a Python
        # handler (a late Ctrl-C would then kill the process: status -2), but not for SIG_IGN.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code if isinstance(code, int) else 0)
