"""The commands that measure: `benchmark` (registered ops), `custom` (your nn.Module class) and
`tune` (the dispatch table fuse() reads). Each declares its options and how its jobs are built;
the run itself (the options checked, the jobs measured, the exit status) is cli.run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from ..api import build_custom_job, build_job
from ..core.errors import MissingDependency, WideTesseraError
from ..core.files import make_folder
from ..core.job import BenchmarkJob, SweepParams
from ..dispatch.table import TABLE_ENV, default_table_path
from ..measurement.modes import TRAINING_MODES
from ..measurement.settings import RunSettings
from ..measurement.timing import TimingConfig
from ..ops.registry import get_op, op_names
from ..sweep.runner import search_candidates
from ..widen.custom import INPUT_DTYPES, RANDOMNESS
from .options import (
    DEVICE,
    IMPORT,
    NO_SAVE,
    QUIET,
    RUN_OPTIONS,
    SAMPLING,
    SELECTION,
    load_object,
    model_kwargs,
    options,
    parse_shape,
    usage_errors,
)
from .run import run_measuring

__all__ = ["benchmark", "custom", "tune"]

_EXIT_STATUS = """
    Exit status: 0 when every strategy ran and was correct; 1 when any was incorrect,
    failed, timed out or crashed; 2 for bad input; 4 when -o FILE could not be written
    with the latest points; 3 with --strict when a result is unreliable; 130 when
    interrupted (what was measured is saved, marked incomplete).
"""

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

    run_measuring(jobs, preset, command="benchmark", **given)


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

    run_measuring(jobs, "custom", command="custom", **given)


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
    run_measuring(
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
