"""The `wide_tessera` command: list ops, run benchmarks, show saved results."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import click
import torch

from .api import build_job, resolve_device
from .bench.registry import REGISTRY, op_names
from .bench.report import format_table
from .bench.runner import run
from .bench.schema import load_results, save_results
from .bench.timing import TimingConfig
from .errors import WideTesseraError

__all__ = ["cli", "main"]


def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        return text.strip()


def parse_override(text: str) -> Tuple[str, List[Any]]:
    """'channels=32,64' -> ('channels', [32, 64]); values become int or bool where they read as one."""
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise WideTesseraError(f"--set {text!r}: expected AXIS=V1,V2,... (e.g. channels=32,64)")
    return key.strip(), [_parse_value(v) for v in values.split(",")]


def _check_output(path: Optional[str]) -> None:
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise WideTesseraError(f"-o {path}: is a directory; give a file path")
    if not p.parent.is_dir():
        raise WideTesseraError(f"-o {path}: folder {str(p.parent)!r} does not exist")


def _timing_config(device: str, target_ci: float, budget: float, cuda_graph: bool) -> TimingConfig:
    if cuda_graph and not device.startswith("cuda"):
        raise WideTesseraError(f"--cuda-graph needs a CUDA device; the run is on {device}")
    try:
        return TimingConfig(target_rel_ci=target_ci, budget_s=budget, cuda_graph=cuda_graph)
    except ValueError as e:
        raise WideTesseraError(
            str(e).replace("target_rel_ci=", "--target-ci ").replace("budget_s=", "--budget ")
        ) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="wide_tessera")
def cli() -> None:
    """When does fusing N copies of an op beat N separate calls, and which strategy wins?"""


@cli.command("list")
def list_ops() -> None:
    """Every op with its strategies, presets and sweep axes."""
    for name in op_names():
        cls = REGISTRY[name]
        aliases = [k for k, v in REGISTRY.items() if v is cls and k != name]
        click.echo(f"{name}" + (f" (alias: {', '.join(aliases)})" if aliases else "") + f"  [{cls.__name__}]")
        click.echo(f"  strategies: baseline, {', '.join(cls.BENCHMARK_STRATEGIES)}")
        rows = [
            [
                preset,
                ",".join(map(str, sweep.n_values)),
                str(sweep.n_points()),
                " ".join(f"{k}={','.join(map(str, v))}" for k, v in sweep.axes.items()),
            ]
            for preset, sweep in cls.BENCHMARK_SWEEPS.items()
        ]
        click.echo("  " + format_table(["preset", "n_values", "points", "axes"], rows).replace("\n", "\n  "))


@cli.command()
@click.argument("names", nargs=-1)
@click.option("--all", "run_all", is_flag=True, help="Benchmark every registered op.")
@click.option("--preset", default="full", show_default=True, help="Sweep preset: ci, quick or full.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N  [default: cuda if available, else cpu]")
@click.option("-o", "--output", default=None, help="Write every result of the run to this JSON file.")
@click.option("--n-values", default=None, metavar="N1,N2,...", help="Replace the preset's N values.")
@click.option("--set", "sets", multiple=True, metavar="AXIS=V1,V2", help="Replace a sweep axis (repeatable).")
@click.option("--seed", default=0, show_default=True, help="Seed for models and inputs.")
@click.option("--threads", type=int, default=None, help="CPU threads for torch  [default: torch's choice]")
@click.option(
    "--target-ci",
    type=float,
    default=TimingConfig.target_rel_ci,
    show_default=True,
    help="Sample until each median's 95% CI is narrower than this fraction of it.",
)
@click.option(
    "--budget", type=float, default=TimingConfig.budget_s, show_default=True, help="Sampling seconds per function."
)
@click.option("--cuda-graph", is_flag=True, help="CUDA only: time CUDA-graph replays, without launch overhead.")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def benchmark(
    names: Tuple[str, ...],
    run_all: bool,
    preset: str,
    device: Optional[str],
    output: Optional[str],
    n_values: Optional[str],
    sets: Tuple[str, ...],
    seed: int,
    threads: Optional[int],
    target_ci: float,
    budget: float,
    cuda_graph: bool,
    quiet: bool,
) -> None:
    """Benchmark ops: N separate calls against every wide strategy.

    \b
    Examples:
      wide_tessera benchmark --all --preset quick
      wide_tessera benchmark conv1d conv2d --preset ci -o results.json
      wide_tessera benchmark gemm --n-values 4,8 --set batch=64 --set dtype=float32,bfloat16
      wide_tessera benchmark flash_attention --preset quick --device cuda --cuda-graph

    Exit status: 0 when every strategy was correct, 1 when any was incorrect, 2 for bad input.
    """
    try:
        if run_all == bool(names):
            raise WideTesseraError("name one or more ops, or give --all (see `wide_tessera list`)")
        overrides: Dict[str, Any] = dict(parse_override(s) for s in sets)
        if n_values is not None:
            overrides["n_values"] = [_parse_value(v) for v in n_values.split(",")]
        _check_output(output)
        resolved = resolve_device(device)
        timing = _timing_config(resolved, target_ci, budget, cuda_graph)
        if threads is not None:
            if threads <= 0:
                raise WideTesseraError(f"--threads {threads}: give a positive number of threads")
            torch.set_num_threads(threads)
        jobs = [build_job(name, preset, resolved, **overrides) for name in (op_names() if run_all else names)]
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None

    results = []
    for job in jobs:
        result = run(job, device=resolved, verbose=not quiet, seed=seed, timing=timing)
        results.append(result)
        click.echo(result.summary() + "\n")
    if output:
        save_results(results, output)
        click.echo(f"wrote {len(results)} result(s) to {output}", err=True)
    failures = [f"{r.op}: {f}" for r in results for f in r.failures]
    if failures:
        click.echo(f"{len(failures)} incorrect strategy result(s):\n  " + "\n  ".join(failures), err=True)
        sys.exit(1)


@cli.command()
@click.argument("path")
def show(path: str) -> None:
    """Print the summaries stored in a results file written by `benchmark -o`."""
    try:
        results = load_results(path)
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None
    for result in results:
        click.echo(result.summary() + "\n")


def main() -> None:
    cli(prog_name="wide_tessera")
