"""A measuring command's run of several jobs: every result saved after every point, a Ctrl-C
saving what was measured, `--resume` continuing a file, and torchrun's ranks sharing the work.

The command line's `benchmark`, `custom` and `tune` are this module and a printer: it
measures and writes; they check the options, show the results and choose the exit status.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..core.environment import capture_environment
from ..core.errors import Interrupted, WideTesseraError
from ..core.job import BenchmarkJob, group_key, point_keys
from ..measurement.settings import RunSettings
from ..results.schema import BenchmarkResult, ResultsFile, save_results
from .progress import Progress
from .resume import check_resumable, point_order, points_left
from .runner import JobRun, run_jobs, search_candidates
from .shards import Shard, assign, joined, mark, remove_shards, shard_path, with_shards

__all__ = ["previous_results", "measure_jobs", "measure_shard", "points_to_measure"]


def previous_results(
    path: str, results: List[BenchmarkResult], settings: RunSettings, sharded: bool = False
) -> Dict[str, BenchmarkResult]:
    """Every result in the file a --resume continues (`results`, read from `path` by the caller),
    and in the shard files a sharded run left beside it (a rank died), by op, each checked to be
    measured as this run measures."""
    previous = {r.op: r for r in results}
    if len(previous) < len(results):
        raise WideTesseraError(f"--resume: {path} holds more than one result for an op; it was not written by one run")
    previous = with_shards(previous, path)
    environment = capture_environment(settings.device)
    if sharded:  # ranks run on cuda:0, cuda:1, ...; the file says cuda
        environment = dataclasses.replace(environment, device=environment.device.split(":")[0])
    for r in previous.values():
        check_resumable(r, path, settings, environment)
    return previous


def points_to_measure(jobs: Sequence[BenchmarkJob], settings: RunSettings, previous: Dict[str, BenchmarkResult]) -> int:
    """How many points the jobs still measure (before confirmation), given what `previous` holds;
    a crossover search, at most about log2 of its candidates per group."""
    if settings.search is not None:
        per_group = 1 + math.ceil(math.log2(len(search_candidates(settings.search))))
        return sum(per_group * len(list(job.sweep.param_grid())) for job in jobs)
    return sum(points_left(job.sweep, previous.get(job.op)) for job in jobs)


def _others(previous: Dict[str, BenchmarkResult], jobs: Sequence[BenchmarkJob]) -> List[BenchmarkResult]:
    """The results of the file that no job of this run measures: they are kept as they are."""
    ops = {job.op for job in jobs}
    return [r for op, r in previous.items() if op not in ops]


def _run_jobs(
    jobs: Sequence[BenchmarkJob],
    settings: RunSettings,
    previous: Dict[str, BenchmarkResult],
    kept: List[BenchmarkResult],
    output: Optional[str],
    progress: Progress,
    unsaved: List[str],
    latest: Dict[str, BenchmarkResult],
    share: Optional[Callable[[str, Dict[str, Any]], bool]] = None,
    finish: Callable[[BenchmarkResult], BenchmarkResult] = lambda result: result,
    on_result: Callable[[BenchmarkResult], None] = lambda result: None,
) -> List[BenchmarkResult]:
    """Measure the jobs (each one's `share(op, params)` of the groups in a sharded run), every
    first pass before any confirmation (runner.run_jobs); `kept` and each job's `latest` result
    are saved after every point, and Ctrl-C saves what was measured and raises Interrupted.
    `finish` completes each result before it is kept (a sharded run names the rank that measured
    each point); `on_result` hears of each job as it completes. `unsaved` holds why the latest
    save failed, empty once one succeeds (each save writes everything)."""
    file = ResultsFile(output) if output else None

    def save(result: BenchmarkResult) -> None:
        latest[result.op] = finish(result)
        if file is not None:
            try:
                file.write([*kept, *(latest[job.op] for job in jobs if job.op in latest)])
                unsaved.clear()
            except WideTesseraError as e:  # the file or its folder changed under the run
                if str(e) not in unsaved:  # one line per problem; the measuring goes on
                    unsaved.append(str(e))
                    print(f"{e}: the points measured are still printed at the end of each op", file=sys.stderr)

    runs = []
    for job in jobs:
        earlier = previous.get(job.op)
        if _holds_every_point(job, earlier):
            latest[job.op] = earlier  # it holds every point this run asks for
            on_result(earlier)
            continue
        mine = None if share is None else partial(share, job.op)
        runs.append(JobRun(job, settings, earlier, on_point=save, progress=progress, share=mine))
    try:
        for result in run_jobs(runs):
            save(result)
            on_result(latest[result.op])
    except Interrupted as stop:
        save(stop.result)
        others = [latest[job.op] for job in jobs if job.op in latest and job.op != stop.result.op]
        raise Interrupted(stop.result, output, [r for r in others if r.points]) from None
    return [latest[job.op] for job in jobs]  # every job completed: its final result


def _holds_every_point(job: BenchmarkJob, earlier: Optional[BenchmarkResult]) -> bool:
    if earlier is None or not earlier.complete:
        return False
    return len(point_order(job.sweep, earlier.points)) == len(earlier.points)


def measure_jobs(
    jobs: Sequence[BenchmarkJob],
    settings: RunSettings,
    previous: Dict[str, BenchmarkResult],
    output: Optional[str],
    progress: Progress,
    on_result: Callable[[BenchmarkResult], None],
) -> Tuple[List[BenchmarkResult], List[BenchmarkResult], List[str]]:
    """Measure every job in this process; `on_result` hears of each finished one. The results of
    the file that no job measures, the jobs' results, and why `output` lacks the latest of them
    (empty when the last save succeeded)."""
    kept = _others(previous, jobs)
    unsaved: List[str] = []
    results = _run_jobs(jobs, settings, previous, kept, output, progress, unsaved, {}, on_result=on_result)
    if output and previous:  # a resumed run's shards are in the file now
        remove_shards(output)
    return kept, results, unsaved


def measure_shard(
    jobs: Sequence[BenchmarkJob],
    settings: RunSettings,
    previous: Dict[str, BenchmarkResult],
    output: Optional[str],
    progress: Progress,
    shard: Shard,
) -> Optional[Tuple[List[BenchmarkResult], List[BenchmarkResult], List[str]]]:
    """This rank's groups of every job, saved to its shard file after every point; on rank 0,
    every rank's results joined (and written to `output`): the file's other results, the jobs'
    results and the errors of ranks that raised. None on the other ranks. A rank that raises
    still hands over what it measured."""
    owner = assign(jobs, shard.ranks, {op: point_keys(r.points) for op, r in previous.items()})
    where = shard.where(settings.device)
    path = str(shard_path(output, shard.rank)) if output else None
    latest: Dict[str, BenchmarkResult] = {}

    def marked(result: BenchmarkResult) -> BenchmarkResult:
        earlier = previous.get(result.op)
        return mark(result, where, point_keys(earlier.points) if earlier else set())

    error = None
    unsaved: List[str] = []  # only for --resume: rank 0 gathers the points themselves and saves them
    try:
        owns = partial(_owns, owner, shard.rank)
        _run_jobs(jobs, settings, previous, [], path, progress, unsaved, latest, owns, marked)
    except Exception as e:  # noqa: BLE001  a bug, say: the other ranks' points must not be lost
        error = f"rank {shard.rank}: {type(e).__name__}: {e}"
    mine = [latest[job.op] for job in jobs if job.op in latest]
    gathered = shard.gather((mine, error))
    if gathered is None:
        return None
    results = []
    for job in jobs:
        parts = [r for rank_results, _ in gathered for r in rank_results if r.op == job.op]
        earlier = previous[job.op].points if job.op in previous else []
        if parts:
            results.append(joined(job, parts, earlier))
    kept = _others(previous, jobs)
    if output:
        save_results([*kept, *results], output)
        if not any(e for _, e in gathered):  # the shards are in the file now
            remove_shards(output)
    return kept, results, [e for _, e in gathered if e]


def _owns(owner: Dict[Tuple[str, str], int], rank: int, op: str, params: Dict[str, Any]) -> bool:
    return owner[(op, group_key(params))] == rank
