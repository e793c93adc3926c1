"""Runs under torchrun: the ranks' process group (torchrun's own rendezvous, gloo on the CPU and
nccl on GPUs) and the `collectives` command's run, table and file."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..measurement.timing import TimingConfig
from ..reports.text import format_table
from ..results.manifest import capture_manifest, now
from ..sweep.shards import describe_device, rank_threads
from .cases import CollectiveResult, CollectivesRun, run_all, save_collectives

__all__ = ["run_collectives", "summary"]

def run_collectives(
    ops: Sequence[str],
    byte_sizes: Sequence[int],
    dtypes: Sequence[str],
    placements: Sequence[str],
    device: str,
    config: TimingConfig,
    output: Optional[str],
    quiet: bool,
) -> bool:
    """Join the ranks' group, run every case, and on rank 0 print the table and write the file;
    on every rank, whether every result was correct."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:  # each rank its share of the cores
        torch.set_num_threads(rank_threads())
    dist.init_process_group(backend)
    try:
        rank = dist.get_rank()
        where = [None] * dist.get_world_size()
        dist.all_gather_object(where, (socket.gethostname(), describe_device(device)))
        run = CollectivesRun(backend, dist.get_world_size(), [h for h, _ in where], [d for _, d in where],
                             capture_manifest(device, seed=0))

        def report(result: CollectiveResult) -> None:
            run.results.append(result)
            if rank == 0 and not quiet:
                print(f"[collectives] {_line(result)}", file=sys.stderr, flush=True)
            if rank == 0 and output:
                save_collectives(run, output)

        run_all(ops, byte_sizes, dtypes, placements, device, config, on_result=report)
        run.manifest = replace(run.manifest, finished=now())
        if rank == 0:
            print(summary(run), flush=True)
            if output:
                save_collectives(run, output)
                print(f"wrote {len(run.results)} result(s) to {output}", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()
    return all(r.correct is not False for r in run.results)


def _line(r: CollectiveResult) -> str:
    what = f"{r.op} {r.placement} {r.dtype} {r.size_bytes} B"
    if r.skipped:
        return f"{what}: skipped: {r.skipped}"
    return f"{what}: {r.stats.median_ms * 1e3:.1f} us, busbw {r.busbw_gbps:.3g} GB/s" + (
        "" if r.correct else " INCORRECT"
    )


def summary(run: CollectivesRun) -> str:
    """The table: nccl-tests' columns (size, count, type, time, algbw, busbw, correct), our statistics."""
    rows = []
    for r in run.results:
        if r.skipped:
            rows.append(
                [
                    r.op,
                    r.placement,
                    r.dtype,
                    str(r.size_bytes),
                    str(r.count),
                    "-",
                    "-",
                    "-",
                    "-",
                    f"skipped: {r.skipped}",
                ]
            )
            continue
        lo, hi = (x * 1e3 for x in r.stats.median_ci_ms)
        rows.append([
            r.op, r.placement, r.dtype, str(r.size_bytes), str(r.count),
            f"{r.stats.median_ms * 1e3:.1f}" + ("" if r.stats.converged else " ~"),
            f"[{lo:.1f}, {hi:.1f}]", f"{r.algbw_gbps:.3g}", f"{r.busbw_gbps:.3g}", "yes" if r.correct else "NO",
        ])  # fmt: skip
    devices, hosts = ", ".join(sorted(set(run.devices))), ", ".join(sorted(set(run.hosts)))
    header = f"== collectives: {run.ranks} ranks, {run.backend}, on {devices} ({hosts})"
    table = format_table(
        ["op", "placement", "dtype", "size B", "count", "time us", "95% CI us", "algbw GB/s", "busbw GB/s", "correct"],
        rows,
    )
    note = (
        "time: median per call of the slowest rank (~: its CI did not reach the target within the budget); algbw = "
        "size / time; busbw = algbw x 2(n-1)/n for all_reduce, "
        "x (n-1)/n for all_gather, reduce_scatter and all_to_all, x 1 for broadcast (nccl-tests)"
    )
    return f"{header}\n{table}\n{note}"
