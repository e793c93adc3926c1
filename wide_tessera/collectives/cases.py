"""The collectives themselves, under torchrun: all_reduce, all_gather, reduce_scatter, all_to_all
and broadcast over message sizes, each result checked, timed with the statistics of every other
timing (core.stats), with algbw and busbw exactly as nccl-tests defines them.

They decide whether N models belong on one device or spread over several: a fused op's
saving on one GPU is worth little if the N copies' gradients then cost an all_reduce each.

Every rank runs every case in lockstep: the number of calls per sample and when to stop are
decided from values all ranks share (each sample is the slowest rank's time, reduced with MAX),
so no rank waits in a collective the others have left.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from dataclasses_json import dataclass_json

from ..core.files import not_a_regular_file
from ..core.job import DTYPES
from ..core.jsonio import load_document, write_json
from ..core.stats import TimingStats, median_ci_rel_width
from ..measurement.timing import TimingConfig
from ..results.manifest import Manifest

__all__ = [
    "COLLECTIVES",
    "KIND",
    "PLACEMENTS",
    "CollectiveResult",
    "CollectivesRun",
    "load_collectives",
    "is_collectives_file",
    "save_collectives",
    "rows",
    "busbw_factor",
    "algbw_gbps",
    "run_case",
    "expected",
    "sizes",
]

FORMAT = "wide_tessera collectives"
KIND = f"a {FORMAT}"  # what its files hold, in the words of files.results_target

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

# Where the output goes. torch.distributed's all_reduce and broadcast work in place only;
# all_to_all_single cannot write over its input; all_gather_into_tensor and
# reduce_scatter_tensor take either, in place meaning the rank's own chunk of the output
# is its input (nccl-tests' in-place layout).
PLACEMENTS: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ("in_place",),
    "broadcast": ("in_place",),
    "all_gather": ("in_place", "out_of_place"),
    "reduce_scatter": ("in_place", "out_of_place"),
    "all_to_all": ("out_of_place",),
}

# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md): busbw = algbw * factor, so that the
# number compares with the hardware's link bandwidth whatever the number of ranks.
_BUSBW = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def busbw_factor(op: str, ranks: int) -> float:
    return _BUSBW[op](ranks)


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth, S / t, in GB/s (10^9 bytes). S is the whole array: for
    all_gather the gathered output, for reduce_scatter the input, for all_to_all one rank's send buffer."""
    return size_bytes / seconds / 1e9


def sizes(min_bytes: int, max_bytes: int) -> List[int]:
    """Powers of two from min_bytes to max_bytes (each rounded up to a power of two)."""
    low = 1 << max(0, math.ceil(math.log2(min_bytes)))
    return [s for s in (low << i for i in range(64)) if s <= max_bytes] or [low]


@dataclass_json
@dataclass
class CollectiveResult:
    """One collective at one size, dtype and placement, over `ranks` ranks.

    size_bytes: nccl-tests' S (see algbw_gbps); count: elements of that array. correct: every
    rank's output equals what the collective must give (None when skipped). stats: the
    samples, each the slowest rank's time per call, ms. algbw_gbps, busbw_gbps: from the median.
    skipped: why it did not run (the backend lacks it, the size holds fewer elements than ranks).
    """

    op: str
    size_bytes: int
    count: int
    dtype: str
    placement: str
    ranks: int
    correct: Optional[bool]
    stats: Optional[TimingStats] = None
    algbw_gbps: Optional[float] = None
    busbw_gbps: Optional[float] = None
    error: Optional[str] = None
    skipped: Optional[str] = None


@dataclass_json
@dataclass
class CollectivesRun:
    """One `wide_tessera collectives` run: where (rank 0's manifest, every rank's host and device),
    the backend, and every case's result."""

    backend: str
    ranks: int
    hosts: List[str]
    devices: List[str]
    manifest: Manifest
    results: List[CollectiveResult] = field(default_factory=list)
    format: str = FORMAT
    version: int = 1


def load_collectives(path: Union[str, Path]) -> CollectivesRun:
    """A file written by `collectives -o`; a damaged or foreign one is one line naming it."""
    return load_document(
        path, CollectivesRun, FORMAT, CollectivesRun.version, str(path), "a wide_tessera collectives file"
    )


def save_collectives(run: CollectivesRun, path: Union[str, Path]) -> None:
    write_json(path, run.to_dict(), KIND)


def is_collectives_file(path: Union[str, Path]) -> bool:
    """Whether `path` says it holds collectives (so `show` and `plot` read it as such). Only a
    regular file is read: /dev/full never ends, and a FIFO waits for a writer."""
    if not_a_regular_file(Path(path)) is not None:
        return False
    try:
        with open(path) as f:
            return f'"format": "{FORMAT}"' in f.read()
    except (OSError, UnicodeDecodeError):
        return False


def rows(run: CollectivesRun) -> List[Dict[str, Any]]:
    """Tidy rows, one per case: what `show --format csv|json` prints."""
    table = []
    for r in run.results:
        s = r.stats
        table.append(dict(
            op=r.op, placement=r.placement, dtype=r.dtype, size_bytes=r.size_bytes, count=r.count, ranks=r.ranks,
            backend=run.backend, median_us=s and s.median_ms * 1e3,
            median_ci_low_us=s and s.median_ci_ms[0] * 1e3, median_ci_high_us=s and s.median_ci_ms[1] * 1e3,
            p10_us=s and s.p10_ms * 1e3, p90_us=s and s.p90_ms * 1e3, samples=s and s.n_samples, cv=s and s.cv,
            converged=s and s.converged, algbw_gbps=r.algbw_gbps, busbw_gbps=r.busbw_gbps, correct=r.correct,
            skipped=r.skipped, error=r.error,
        ))  # fmt: skip
    return table


def _values(count: int, rank: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rank `rank`'s data: small integers, so that sums of a few ranks are exact in every dtype."""
    return (torch.arange(count, device=device) % 7 + 1 + rank).to(dtype)


def expected(op: str, count: int, ranks: int, rank: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """What rank `rank` must hold after `op` when rank r contributed _values(., r)."""
    every = [_values(count, r, dtype, device) for r in range(ranks)]
    chunk = count // ranks
    if op == "all_reduce":
        return torch.stack(every).sum(0)
    if op == "broadcast":
        return every[0]
    if op == "all_gather":  # rank r sent the first `chunk` of its values
        return torch.cat([v[:chunk] for v in every])
    if op == "reduce_scatter":
        return torch.stack(every).sum(0)[rank * chunk : (rank + 1) * chunk]
    if op == "all_to_all":  # chunk j of rank r goes to rank j, as its chunk r
        return torch.cat([v[rank * chunk : (rank + 1) * chunk] for v in every])
    raise ValueError(op)


# torch 2.13 renamed the tensor forms (the old names warn); the GPU image's torch 2.11 has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _setup(
    op: str, placement: str, count: int, rank: int, ranks: int, dtype: torch.dtype, device: str
) -> Tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """(call, output): one call of the collective on fresh buffers, and the tensor it fills."""
    chunk = count // ranks
    mine = _values(count, rank, dtype, device)
    if op == "all_reduce":
        buf = mine.clone()
        return lambda: dist.all_reduce(buf), lambda: buf
    if op == "broadcast":
        buf = mine.clone() if rank == 0 else torch.full_like(mine, -1)
        return lambda: dist.broadcast(buf, src=0), lambda: buf
    if op == "all_gather":
        out = torch.full((chunk * ranks,), -1, dtype=dtype, device=device)
        if placement == "in_place":
            inp = out[rank * chunk : (rank + 1) * chunk]
            inp.copy_(mine[:chunk])
        else:
            inp = mine[:chunk].clone()
        return lambda: _ALL_GATHER(out, inp), lambda: out
    if op == "reduce_scatter":
        inp = mine[: chunk * ranks].clone()
        out = (
            inp[rank * chunk : (rank + 1) * chunk]
            if placement == "in_place"
            else torch.empty(chunk, dtype=dtype, device=device)
        )
        return lambda: _REDUCE_SCATTER(out, inp), lambda: out
    if op == "all_to_all":
        inp, out = mine[: chunk * ranks].clone(), torch.full((chunk * ranks,), -1, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(out, inp), lambda: out
    raise ValueError(op)


def _agree(value: float, device: str, op: dist.ReduceOp = dist.ReduceOp.MAX) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(call: Callable[[], None], calls: int, device: str) -> float:
    """ms per call of `calls` calls, started together (a barrier), the slowest rank's."""
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    _sync(device)
    return _agree((time.perf_counter() - start) * 1e3 / calls, device)


def run_case(
    op: str, size_bytes: int, dtype_name: str, placement: str, device: str, config: TimingConfig
) -> CollectiveResult:
    """Check one case on every rank, then time it; every rank returns the same result."""
    ranks, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[dtype_name]
    count = size_bytes // torch.empty(0, dtype=dtype).element_size()
    if op != "all_reduce" and op != "broadcast":
        count -= count % ranks  # nccl-tests likewise rounds the array to whole chunks
    size = count * torch.empty(0, dtype=dtype).element_size()
    base = dict(op=op, size_bytes=size, count=count, dtype=dtype_name, placement=placement, ranks=ranks)
    if count < ranks:
        return CollectiveResult(
            **base, correct=None, skipped=f"{size_bytes} bytes hold fewer {dtype_name} elements than the {ranks} ranks"
        )
    try:
        call, output = _setup(op, placement, count, rank, ranks, dtype, device)
        call()
        _sync(device)
    except (RuntimeError, NotImplementedError) as e:  # the backend lacks it (every rank raises alike)
        return CollectiveResult(**base, correct=None, skipped=f"{dist.get_backend()}: {str(e).splitlines()[0][:160]}")
    mine_ok = bool(torch.equal(output(), expected(op, count, ranks, rank, dtype, device)))
    correct = _agree(0.0 if mine_ok else 1.0, device) == 0.0
    stats = _measure(call, device, config)
    seconds = stats.median_ms / 1e3
    algbw = algbw_gbps(size, seconds)
    return CollectiveResult(
        **base,
        correct=correct,
        stats=stats,
        algbw_gbps=algbw,
        busbw_gbps=algbw * busbw_factor(op, ranks),
        error=None if correct else f"rank output differs from what {op} must give",
    )


def _measure(call: Callable[[], None], device: str, config: TimingConfig) -> TimingStats:
    """Samples until the median's CI is within the target or the budget is spent, the decision
    made from values every rank holds alike.

    Not measurement.timing's timer, which has no place for what a collective needs: every rank
    must call the collective the same number of times, or the ranks that call once more wait
    forever. The timer decides alone on each rank how many calls a sample loops (calibrated on
    that rank's clock), which rounds to throw away and retake (that rank's health monitor) and
    when to stop (that rank's elapsed time); here the loop's length, each sample (the slowest
    rank's, _timed) and the time spent are agreed over all ranks before anything is decided, and
    no round is retaken. A sample starts on every rank together (a barrier), which the timer's
    sampler, timing only the function, cannot put outside the timed loop. And a collective
    waits on the other ranks: the timer's CPU clock (one torch thread) does not count a wait,
    and its monitor names a function that waits as blocked, so a collective is timed by wall
    time alone. What it shares with the timer: the stopping test (median_ci_rel_width against
    target_rel_ci, min_samples, max_samples, budget_s) and TimingConfig."""
    for _ in range(3):  # warm-up: connections, buffers
        call()
    one = _timed(call, 1, device)
    calls = max(1, math.ceil(config.min_sample_s * 1e3 / max(one, 1e-6)))
    samples: List[float] = []
    start = time.perf_counter()
    converged = False
    while len(samples) < config.max_samples:
        samples.append(_timed(call, calls, device))
        spent = _agree(time.perf_counter() - start, device)
        if len(samples) >= config.min_samples:
            converged = median_ci_rel_width(samples) <= config.target_rel_ci
            if converged or spent >= config.budget_s:
                break
    return TimingStats.from_samples(samples, "collective_max_over_ranks", calls, converged)


def run_all(
    ops: Sequence[str], byte_sizes: Sequence[int], dtypes: Sequence[str], placements: Sequence[str], device: str,
    config: TimingConfig, on_result: Callable[[CollectiveResult], None] = lambda r: None,
) -> List[CollectiveResult]:
    """Every op at every size, dtype and placement it supports, in that order."""
    results = []
    for op in ops:
        for dtype in dtypes:
            for placement in (p for p in placements if p in PLACEMENTS[op]):
                for size in byte_sizes:
                    result = run_case(op, size, dtype, placement, device, config)
                    on_result(result)
                    results.append(result)
    return results
