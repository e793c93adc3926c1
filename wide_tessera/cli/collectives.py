"""`wide_tessera collectives`: the collectives under torchrun, one process per rank."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Optional

import click

from ..collectives.cases import COLLECTIVES, KIND, sizes
from ..collectives.torchrun import run_collectives
from ..core.errors import WideTesseraError
from ..core.files import results_target
from ..core.job import DTYPES
from ..core.runs import new_run_path, prepare_runs_dir
from ..measurement.settings import resolve_device
from ..measurement.timing import TimingConfig
from ..sweep.shards import rank_device
from .options import NO_SAVE, QUIET, choices, parse_size

__all__ = ["collectives"]


@click.command()
@click.option("--ops", default=",".join(COLLECTIVES), show_default=True, help="Collectives to run, comma-separated.")
@click.option(
    "--min-bytes", default="1KiB", show_default=True, help="Smallest message (nccl-tests' S; powers of two up)."
)
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
@QUIET
@NO_SAVE
def collectives(
    ops: str, min_bytes: str, max_bytes: str, dtypes: str, placements: str, budget: float, device: Optional[str],
    output: Optional[str], quiet: bool, no_save: bool,
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
    rank = os.environ.get("RANK")
    try:  # every value, before any process group starts; under torchrun one line, from rank 0
        names = choices(ops, "collective", COLLECTIVES)
        kinds = choices(dtypes, "dtype", DTYPES)
        where = choices(placements, "placement", ("in_place", "out_of_place"))
        low, high = parse_size(min_bytes, "--min-bytes"), parse_size(max_bytes, "--max-bytes")
        if low > high:
            raise WideTesseraError(f"--min-bytes {min_bytes} is larger than --max-bytes {max_bytes}")
        config = TimingConfig(budget_s=budget)
        device = rank_device(resolve_device(device))
        if output:
            results_target(output, KIND)
        if rank is None or "WORLD_SIZE" not in os.environ:
            raise WideTesseraError(
                "collectives runs under torchrun, one process per rank: "
                "torchrun --standalone --nproc-per-node 2 -m wide_tessera collectives"
            )
    except WideTesseraError as e:
        if rank not in (None, "0"):  # rank 0 says it
            sys.exit(2)
        raise click.UsageError(str(e)) from None
    if output is None and rank == "0" and not no_save:
        try:
            prepare_runs_dir()
            output = str(new_run_path("collectives", names, "-", uuid.uuid4().hex))
        except WideTesseraError as e:
            click.echo(f"{e}: this run is not kept (--no-save skips keeping it)", err=True)
    if not run_collectives(names, sizes(low, high), kinds, where, device, config, output, quiet):
        sys.exit(1)
