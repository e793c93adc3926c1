"""The `wide_tessera` command: list ops, run benchmarks, show saved results."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import click
import torch

from .api import build_job, resolve_device
from .bench.job import BenchmarkJob
from .bench.point import CONFIRM_MODES
from .bench.registry import REGISTRY, op_names
from .bench.report import format_table
from .bench.runner import RunInterrupted, RunSettings, run_job
from .bench.schema import BenchmarkResult, load_results, save_results
from .bench.stages import StageTimeouts
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


def _check_output(path: Optional[str], resume: bool) -> None:
    if path is None:
        if resume:
            raise WideTesseraError("--resume needs -o FILE: the results file to continue")
        return
    p = Path(path)
    if p.is_dir():
        raise WideTesseraError(f"-o {path}: is a directory; give a file path")
    if not p.parent.is_dir():
        raise WideTesseraError(f"-o {path}: folder {str(p.parent)!r} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise WideTesseraError(f"-o {path}: folder {str(p.parent)!r} is not writable")
    if resume and not p.exists():
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


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1.5g', '1048576' -> bytes (K, M, G are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise WideTesseraError(f"--memory-budget {text!r}: expected a positive size such as 512MiB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _previous_results(path: str, preset: str, device: str) -> Dict[str, BenchmarkResult]:
    """The results a --resume continues, by op, after checking they were measured the same way."""
    previous = {r.op: r for r in load_results(path)}
    for r in previous.values():
        if (r.preset, r.device) != (preset, device):
            raise WideTesseraError(
                f"--resume: {path} has {r.op} measured with preset {r.preset} on {r.device}; "
                f"this run asks for preset {preset} on {device}"
            )
    return previous


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
@click.option("-o", "--output", default=None, help="Write every result to this JSON file, after every point.")
@click.option("--resume", is_flag=True, help="Continue the incomplete results in -o FILE, skipping measured points.")
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
@click.option("--isolate", is_flag=True, help="Run each op in a worker process: a hang or crash costs one strategy.")
@click.option(
    "--timeout-multiplier", type=float, default=1.0, show_default=True, help="Scale every stage's time limit."
)
@click.option("--memory-budget", default=None, metavar="SIZE", help="Skip points estimated above SIZE (e.g. 4GiB).")
@click.option(
    "--confirm",
    type=click.Choice(CONFIRM_MODES),
    default="deciding",
    show_default=True,
    help="Which points to measure again, independently, after the sweep; disagreeing points are unstable.",
)
@click.option("--strict", is_flag=True, help="Exit 3 when a result is UNRELIABLE (busy machine, unstable points...).")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
def benchmark(
    names: Tuple[str, ...],
    run_all: bool,
    preset: str,
    device: Optional[str],
    output: Optional[str],
    resume: bool,
    n_values: Optional[str],
    sets: Tuple[str, ...],
    seed: int,
    threads: Optional[int],
    target_ci: float,
    budget: float,
    cuda_graph: bool,
    isolate: bool,
    timeout_multiplier: float,
    memory_budget: Optional[str],
    confirm: str,
    strict: bool,
    quiet: bool,
) -> None:
    """Benchmark ops: N separate calls against every wide strategy.

    \b
    Examples:
      wide_tessera benchmark --all --preset quick
      wide_tessera benchmark conv1d conv2d --preset ci -o results.json
      wide_tessera benchmark gemm --n-values 4,8 --set batch=64 --set dtype=float32,bfloat16
      wide_tessera benchmark flash_attention --preset quick --device cuda --cuda-graph
      wide_tessera benchmark --all --preset full --isolate -o full.json   (Ctrl-C, then add --resume)

    Exit status: 0 when every strategy ran and was correct; 1 when any was incorrect,
    failed, timed out or crashed; 2 for bad input; 3 with --strict when a result is
    unreliable; 130 when interrupted (what was measured is saved, marked incomplete).
    """
    try:
        if run_all == bool(names):
            raise WideTesseraError("name one or more ops, or give --all (see `wide_tessera list`)")
        overrides: Dict[str, Any] = dict(parse_override(s) for s in sets)
        if n_values is not None:
            overrides["n_values"] = [_parse_value(v) for v in n_values.split(",")]
        _check_output(output, resume)
        resolved = resolve_device(device)
        settings = RunSettings(
            resolved,
            seed,
            _timing_config(resolved, target_ci, budget, cuda_graph),
            _timeouts(timeout_multiplier),
            None if memory_budget is None else parse_size(memory_budget),
            isolate,
            confirm,
        )
        if threads is not None:
            if threads <= 0:
                raise WideTesseraError(f"--threads {threads}: give a positive number of threads")
            torch.set_num_threads(threads)
        jobs = [build_job(name, preset, resolved, **overrides) for name in (op_names() if run_all else names)]
        previous = _previous_results(output, preset, resolved) if resume else {}
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None

    results: List[BenchmarkResult] = []
    for job in jobs:
        result = _run_job(job, settings, previous.get(job.op), results, output, quiet)
        results.append(result)
        click.echo(result.summary() + "\n")
    if output:
        click.echo(f"wrote {len(results)} result(s) to {output}", err=True)
    failures = [f"{r.op}: {f}" for r in results for f in r.failures]
    if failures:
        click.echo(f"{len(failures)} failure(s):\n  " + "\n  ".join(failures), err=True)
        sys.exit(1)
    unreliable = [f"{r.op}: {'; '.join(r.unreliable_reasons)}" for r in results if not r.reliable]
    if strict and unreliable:
        click.echo(f"--strict: {len(unreliable)} unreliable result(s):\n  " + "\n  ".join(unreliable), err=True)
        sys.exit(3)


def _run_job(
    job: BenchmarkJob,
    settings: RunSettings,
    previous: Optional[BenchmarkResult],
    done: List[BenchmarkResult],
    output: Optional[str],
    quiet: bool,
) -> BenchmarkResult:
    """Measure one job, saving after every point; on Ctrl-C save what was measured and exit 130."""
    if previous is not None and previous.complete:
        return previous

    def save(result: BenchmarkResult) -> None:
        if output:
            save_results([*done, result], output)

    try:
        result = run_job(job, settings, previous, on_point=save, verbose=not quiet)
    except RunInterrupted as stop:
        save(stop.result)
        where = f"saved {len(stop.result.points)} point(s) of {job.op} to {output}; continue with --resume"
        click.echo(f"\ninterrupted: {where}" if output else "\ninterrupted (nothing saved: no -o FILE)", err=True)
        sys.exit(130)
    save(result)
    return result


def _timeouts(multiplier: float) -> StageTimeouts:
    try:
        return StageTimeouts(multiplier=multiplier)
    except ValueError:
        raise WideTesseraError(f"--timeout-multiplier {multiplier}: give a positive number") from None


@cli.command()
@click.argument("path")
@click.option("--warnings", "all_warnings", is_flag=True, help="List every warning, not only the digest.")
def show(path: str, all_warnings: bool) -> None:
    """Print the summaries stored in a results file written by `benchmark -o`."""
    try:
        results = load_results(path)
    except WideTesseraError as e:
        raise click.UsageError(str(e)) from None
    for result in results:
        click.echo(result.summary() + "\n")
        if all_warnings:
            click.echo(f"all {len(result.warnings)} warning(s) of {result.op}:")
            click.echo("".join(f"  {w}\n" for w in result.warnings))


def main() -> None:
    cli(prog_name="wide_tessera")
