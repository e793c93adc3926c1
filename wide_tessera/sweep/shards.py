"""A run's points split over torchrun's ranks, and the ranks' results joined into one.

`torchrun --nproc-per-node K -m wide_tessera benchmark ...` starts K processes; each
measures whole parameter groups (so its confirmation pass and crossovers need no other
rank), saves what it measured to its own shard file after every point (`FILE.rankR`), and
rank 0 gathers every rank's results into FILE, of the form a single process writes, each
point naming the rank, host and device that measured it. The group and its rendezvous are
torchrun's (gloo carries the results: they are Python objects on the CPU whatever the device).
A rank that dies leaves its shard file; `--resume` reads the shards and measures what is missing.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from ..core.environment import capture_environment
from ..core.errors import WideTesseraError
from ..core.job import BenchmarkJob, group_key, point_key, point_keys
from ..results import analysis
from ..results.load import load_results
from ..results.manifest import Manifest
from ..results.schema import BenchmarkResult, PointResult, Where
from .resume import point_order

__all__ = [
    "Shard", "rank_device", "rank_threads", "describe_device", "assign", "shard_path", "leftover_shards",
    "with_shards", "remove_shards", "joined", "mark",
]


def rank_device(device: str) -> str:
    """A torchrun rank's device: its own GPU, cuda:LOCAL_RANK; on the CPU, 'cpu' for every rank."""
    return f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if device.startswith("cuda") else device


def rank_threads() -> int:
    """A torchrun rank's torch threads on the CPU: its share of the node's cores."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def describe_device(device: str) -> str:
    """'cuda:1 (NVIDIA H100 80GB HBM3)': how a rank's device is recorded."""
    return f"{device} ({capture_environment(device).device_name})"


@dataclass(frozen=True)
class Shard:
    """This process's place among torchrun's ranks."""

    rank: int
    ranks: int

    @classmethod
    def from_environment(cls) -> Optional["Shard"]:
        """The shard torchrun's environment gives; None in a plain process (or a world of one)."""
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        if ranks <= 1:
            return None
        return cls(int(os.environ["RANK"]), ranks)

    def join(self, device: str) -> None:
        """Join torchrun's group; refuse ranks on different device models (their points would
        compare unlike with unlike under one label): one line on every rank."""
        dist.init_process_group("gloo")
        names: List[Any] = [None] * self.ranks
        dist.all_gather_object(names, capture_environment(device).device_name)
        if len(set(names)) > 1:
            dist.destroy_process_group()
            found = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
            raise WideTesseraError(
                f"the ranks are on different devices ({found}); run each device model on its own: a sharded run "
                "puts all its points under one device name"
            )

    def where(self, device: str) -> Where:
        return Where(self.rank, socket.gethostname(), describe_device(device))

    def gather(self, payload: Any) -> Optional[List[Any]]:
        """Every rank's payload on rank 0 (None elsewhere)."""
        gathered: Optional[List[Any]] = [None] * self.ranks if self.rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        return gathered

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def leave(self) -> None:
        dist.destroy_process_group()


def assign(jobs: Sequence[BenchmarkJob], ranks: int, skip: Dict[str, Set[str]]) -> Dict[Tuple[str, str], int]:
    """(op, parameter group) -> rank: each group, whole, to the rank with the fewest points to
    measure so far (the same answer on every rank). `skip`: op -> point keys already measured."""
    load = [0] * ranks
    owner = {}
    for job in jobs:
        groups: Dict[str, int] = {}
        for n, params in job.sweep.points():
            todo = point_key(n, params) not in skip.get(job.op, set())
            key = group_key(params)
            groups[key] = groups.get(key, 0) + todo
        for key, points in groups.items():
            rank = min(range(ranks), key=lambda r: load[r])
            owner[(job.op, key)] = rank
            load[rank] += points
    return owner


def shard_path(output: str, rank: int) -> Path:
    return Path(f"{output}.rank{rank}")


def leftover_shards(output: str) -> List[Path]:
    """Shard files a sharded run left beside `output` (a rank died, or the run was interrupted)."""
    folder = Path(output).resolve().parent
    name = Path(output).resolve().name
    return sorted(p for p in folder.glob(f"{name}.rank*") if p.name[len(name) + 5 :].isdigit())


def with_shards(previous: Dict[str, BenchmarkResult], output: str) -> Dict[str, BenchmarkResult]:
    """`previous` (the results in `output`, by op) with the points of the shard files beside it
    that it lacks and the manifests of the runs that measured them; a result a shard touches is
    marked incomplete, for --resume to finish."""
    merged = dict(previous)
    for part in (r for path in leftover_shards(output) for r in load_results(path)):
        whole = merged.setdefault(part.op, part)
        have = point_keys(whole.points)
        points = [*whole.points, *(p for p in part.points if point_key(p.n, p.params) not in have)]
        merged[part.op] = dataclasses.replace(whole, points=points, runs=_runs([whole, part]), complete=False)
    return merged


def remove_shards(output: str) -> None:
    """Remove the shard files beside `output`, once their points are in it."""
    for path in leftover_shards(output):
        path.unlink()


def _runs(results: Sequence[BenchmarkResult]) -> List[Manifest]:
    """The results' run manifests, each once."""
    return list({run.run_id: run for r in results for run in r.runs}.values())


def mark(result: BenchmarkResult, where: Where, earlier: Set[str]) -> BenchmarkResult:
    """`result` with its points measured in this run (not in `earlier`) naming who measured them."""
    points = [p if point_key(p.n, p.params) in earlier else dataclasses.replace(p, where=where) for p in result.points]
    return dataclasses.replace(result, points=points)


def joined(job: BenchmarkJob, results: Sequence[BenchmarkResult], earlier: Sequence[PointResult]) -> BenchmarkResult:
    """One result of `job` from the ranks' results (and the points of an earlier run, `earlier`),
    of the form a single process gives: every point once, in the sweep's order; crossovers,
    wins and reliability computed over all of them; every rank's manifest in `runs`."""
    before = {point_key(p.n, p.params): p for p in earlier}
    points: Dict[str, PointResult] = dict(before)
    for result in results:
        for p in result.points:
            key = point_key(p.n, p.params)
            if key not in before:
                points[key] = p
    order = point_order(job.sweep, earlier)
    first = results[0]
    environment = dataclasses.replace(first.environment, device=first.environment.device.split(":")[0])
    return analysis.result_of(
        sorted(points.values(), key=lambda p: order[point_key(p.n, p.params)]),
        op=first.op,
        strategies=first.strategies,
        environment=environment,
        timer=first.timer,
        settings=dataclasses.replace(first.settings, device=environment.device),
        duration_s=max(r.duration_s for r in results),
        memory_method=first.memory_method,
        # a rank that raised leaves its groups out: complete only when every point of the sweep is in
        complete=all(r.complete for r in results)
        and (first.settings.search is not None or {point_key(n, p) for n, p in job.sweep.points()} <= set(points)),
        peaks=first.peaks,
        runs=_runs(results),
    )
