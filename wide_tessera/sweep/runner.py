"""The one point loop: measure a job's points, confirm the deciding ones, analyse.

The API and the CLI both run jobs here; the CLI's saving after every point and
its --resume are the `on_point` hook and the `previous` points. Points are
measured in this process (`point.iter_points`) or in isolated workers
(`isolation.iter_points_isolated`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional, Sequence, Set

import torch

from ..core.environment import capture_environment
from ..core.errors import Interrupted, WideTesseraError
from ..core.job import BenchmarkJob, params_text, point_key, point_keys
from ..measurement.controls import BACKWARD_NOT_COMPILED
from ..measurement.energy import energy_unavailable
from ..measurement.health import load_remedy
from ..measurement.memory import memory_method
from ..measurement.roofline import Peaks, load_or_calibrate
from ..measurement.settings import CONTROLS_AT, RunSettings
from ..measurement.timing import timer_name
from ..results import analysis, passes
from ..results.manifest import Manifest, capture_manifest, now
from ..results.schema import BenchmarkResult, PointResult
from .isolation import check_picklable, iter_points_isolated
from .point import iter_points
from .progress import Progress
from .resume import point_order

__all__ = ["run", "run_job", "run_jobs", "JobRun", "check_runnable"]

# An op whose first this many points were all disturbed stops, where two or more are left: on a
# machine too busy for its threads every later point would be too (issue 48: beside 2 to 4
# runnable threads on the 2 cores, the quick preset took 15 min, not 4.5, and 14 of its 18 ops
# ended DISTURBED all the same; beside two busy loops a disturbed point took 5 to 25 s).
_DISTURBED_TO_STOP = 2

# Confirming can move a crossover, which makes new points deciding; they are confirmed in
# turn, this many times at most.
_CONFIRM_ROUNDS = 3


def run(
    job: BenchmarkJob, settings: Optional[RunSettings] = None, *, verbose: bool = True, **options: Any
) -> BenchmarkResult:
    """Run every point of `job` (in worker processes with `isolate`), confirm, analyse.

    `settings` (measurement.settings.RunSettings), or its fields by name as `options`
    (device=..., timing=..., mode=...): the preset's defaults fill what is not given."""
    if settings is None:
        settings = RunSettings.of(**{"preset": job.preset, **options})
    elif options:
        settings = dataclasses.replace(settings, **options)
    check_runnable(job, settings)
    progress = Progress(job.sweep.n_points(), enabled=verbose)
    try:
        return run_job(job, settings, progress=progress)
    finally:
        progress.close()


def run_job(
    job: BenchmarkJob,
    settings: RunSettings,
    previous: Optional[BenchmarkResult] = None,
    on_point: Optional[Callable[[BenchmarkResult], None]] = None,
    progress: Optional[Progress] = None,
    share: Optional[Callable[[Dict[str, Any]], bool]] = None,
) -> BenchmarkResult:
    """Measure the points of `job` that `previous` lacks, then the confirmation pass.

    `share(params)` says which parameter groups are this process's, in a sharded run
    (sweep.shards): whole groups, so that confirming and crossovers need no other rank.
    `on_point(result)` gets the incomplete result after every measurement (the CLI
    saves it); `progress` hears of each (None: nothing is shown). Ctrl-C raises
    Interrupted carrying that incomplete result. The caller has called
    `check_runnable` (`run` does; the CLI does for all its jobs before the first).
    """
    (result,) = run_jobs([JobRun(job, settings, previous, on_point, progress, share)])
    return result


def run_jobs(runs: Sequence["JobRun"]) -> Iterator[BenchmarkResult]:
    """Every job's first pass, then each job's confirmation and third pass, its result yielded
    as it completes: a point's passes are then a run apart, not seconds.

    Why: this 2-core VM's speed drifts between states that last 5 to 20 s (the same grouped
    conv1d, in one process, on the same tensors: 1.55 ms, then 1.85 ms, then 1.55 again,
    2026-11-25), and two shapes do not drift alike: conv1d's grouped convolution at 64
    channels, N=2, measured 0.95x in 2 of 6 processes and 1.10x in 4, each process agreeing
    with itself. A confirmation taken seconds after the first pass shared its state and its
    answer; taken a run later, it draws the state afresh, and where the two differ the point's
    interval spans both (passes.confirmed)."""
    for job_run in runs:
        job_run.step(job_run.first)
    for job_run in runs:
        if job_run.stopped is None:
            job_run.step(job_run.confirm)
            job_run.step(job_run.third)
        yield job_run.result(complete=True)


class JobRun:
    """One job's run in named passes over explicit state (`points`, by key): the first pass (the
    grid, or a bisection per group under --search), the confirmation of the deciding points, and
    a third pass where the two disagree (passes.disputed). Every point measured is reported at once."""

    def __init__(
        self,
        job: BenchmarkJob,
        settings: RunSettings,
        previous: Optional[BenchmarkResult] = None,
        on_point: Optional[Callable[[BenchmarkResult], None]] = None,
        progress: Optional[Progress] = None,
        share: Optional[Callable[[Dict[str, Any]], bool]] = None,
    ):
        if settings.search is not None:  # every power of two of the range is a candidate; bisection picks
            job = dataclasses.replace(job, sweep=job.sweep.with_overrides(n_values=search_candidates(settings.search)))
        self.job, self.settings, self.on_point = job, settings, on_point
        self.progress = progress or Progress(0, enabled=False)
        earlier = previous.points if previous else []
        # Every earlier point is kept, those outside this sweep too (--resume with other N values).
        self.points: Dict[str, PointResult] = {point_key(p.n, p.params): p for p in earlier}
        self.order = point_order(job.sweep, earlier)
        self.every = {point_key(n, p) for n, p in job.sweep.points()}
        self.sweep = {point_key(n, p) for n, p in job.sweep.points() if share is None or share(p)}
        # The job's own measuring time: its passes are apart, other jobs' passes between them.
        self.spent_s = previous.duration_s if previous else 0.0
        self.step_started: Optional[float] = None
        self.peaks: Optional[Peaks] = None  # measured (or read from the cache) when the job starts
        # This run's manifest joins those of the runs a --resume continues.
        self.earlier_runs = previous.runs if previous else []
        self.manifest = capture_manifest(settings.device, settings.seed)
        # The two passes of each confirmed point, for a third pass to settle; a --resume's earlier
        # points too (interrupted after its confirmations, a run measured no third pass).
        stored = {key: passes.stored_passes(p) for key, p in self.points.items()}
        self.passes: Dict[str, List[PointResult]] = {key: list(both) for key, both in stored.items() if both}
        # A control never decides a verdict, so the second pass leaves the controls out
        # (a gemm+gru quick run: 128 s with them, 119 s without), and the energy, which the
        # first pass measured and no verdict reads.
        # Each pass builds its models and inputs afresh from a seed of its own, so that two passes
        # are independent measurements, as two runs of the tool would be: the same seed rebuilt
        # the same weights, inputs and allocations, and a difference that came from them (an
        # input's alignment, one draw of routing) agreed with itself in both passes.
        self.again = dataclasses.replace(
            settings, controls=False, controls_at=CONTROLS_AT[0], energy=False, seed=settings.seed + 1
        )
        self.stopped: Optional[str] = None  # why the first pass stopped early

    def step(self, one_pass: Callable[[], None]) -> None:
        """Run one of this job's passes; Ctrl-C raises Interrupted with what was measured."""
        self.progress.op(self.job.op)
        self.step_started = time.perf_counter()
        try:
            one_pass()
        except KeyboardInterrupt:
            raise Interrupted(self.result(complete=False)) from None
        finally:
            self.spent_s, self.step_started = self.duration_s(), None

    def duration_s(self) -> float:
        running = 0.0 if self.step_started is None else time.perf_counter() - self.step_started
        return self.spent_s + running

    def ordered(self) -> List[PointResult]:
        return sorted(self.points.values(), key=lambda p: self.order[point_key(p.n, p.params)])

    def result(self, complete: bool) -> BenchmarkResult:
        """The op's result so far; one stopped early is incomplete: --resume measures the rest."""
        ordered = self.ordered()
        runs = [*self.earlier_runs, dataclasses.replace(self.manifest, finished=now())]
        complete = complete and self.stopped is None
        spent = self.duration_s()
        result = _build_result(self.job, self.settings, ordered, spent, complete, self.peaks, runs, self.stopped)
        # the analysed points from now on: the next result keeps each one whose analysis is unchanged,
        # and the results file, written after every point, encodes only the new ones (ResultsFile)
        self.points.update((point_key(p.n, p.params), p) for p in result.points)
        return result

    def measured(self, key: str, point: PointResult, line: str) -> None:
        self.points[key] = point
        self.progress.done(f"[{self.job.op}] {line}")
        if self.on_point is not None:
            self.on_point(self.result(complete=False))

    def first(self) -> None:
        """The sweep's points not measured yet, or under --search a bisection of each group."""
        self.peaks = load_or_calibrate(self.settings.device) if self.settings.roofline else None
        if self.settings.search is not None:
            _bisect_every_group(self.job, self.sweep, self.measure_one)
            return
        skip = set(self.points) | (self.every - self.sweep)
        timed: List[PointResult] = []
        points = _points(self.job, self.settings, skip=skip)
        for point in points:
            line = f"{len(self.points) + 1}/{len(self.order)} {_progress(point)}"
            self.measured(point_key(point.n, point.params), point, line)
            timed += [point] if point.timings else []
            stop = len(timed) == _DISTURBED_TO_STOP and len(self.sweep) >= _DISTURBED_TO_STOP + 2
            if stop and all(p.disturbed for p in timed):
                self.stopped = _stopped_reason(timed, torch.get_num_threads())
                self.progress.done(f"[{self.job.op}] {self.stopped}")
                points.close()  # (isolated workers too)
                return

    def measure_one(self, n: int, params: Dict[str, Any]) -> PointResult:
        """Point (n, params), measured where it is not known yet (a bisection's step)."""
        key = point_key(n, params)
        if key not in self.points:
            for point in _points(self.job, self.settings, skip=self.every - {key}):
                self.measured(key, point, f"search {len(self.points) + 1} {_progress(point)}")
        return self.points[key]

    def confirm(self) -> None:
        """Measure the deciding points again; a confirmation that moves a crossover makes new
        points deciding, confirmed in turn (and under --search, reopens the group's search)."""
        for _ in range(_CONFIRM_ROUNDS):
            todo = point_keys(passes.points_to_confirm(self.ordered(), self.settings.confirm))
            todo &= self.sweep  # a point of an earlier run outside this sweep cannot be rebuilt from it
            self.progress.more(len(todo))
            for i, second in enumerate(_points(self.job, self.again, skip=self.every - todo, facts=False), start=1):
                key = point_key(second.n, second.params)
                self.passes[key] = [self.points[key], second]
                point = passes.confirmed(self.points[key], second)
                self.measured(key, point, f"confirm {i}/{len(todo)} {_confirmation_progress(point)}")
            if not todo:
                return
            if self.settings.search is not None:
                _bisect_every_group(self.job, self.sweep, self.measure_one)

    def third(self) -> None:
        """Passes that contradict each other, or whose clear answer the other pass leaves open,
        get a third, which decides (passes.disputed): an UNRELIABLE flag is the answer only
        where the third pass cannot settle it either."""
        todo = {key for key, both in self.passes.items() if passes.disputed(*both)} & self.sweep
        self.progress.more(len(todo))
        third = dataclasses.replace(self.again, seed=self.settings.seed + 2)
        for i, last in enumerate(_points(self.job, third, skip=self.every - todo, facts=False), start=1):
            key = point_key(last.n, last.params)
            point = passes.settled_by_third(*self.passes[key], last)
            self.measured(key, point, f"third pass {i}/{len(todo)} {_confirmation_progress(point)}")


def _stopped_reason(disturbed: List[PointResult], threads: int) -> str:
    blocked = [p.health.problems[0] for p in disturbed if p.health and p.health.blocked is not None]
    if blocked:  # timed by the CPU clock, which no load disturbs: what it cannot see
        why = blocked[0].removeprefix("disturbed: ")
        return f"stopped after its first {len(disturbed)} points, all disturbed: {why}; --resume measures the rest"
    loads = [p.health.other_load_cores for p in disturbed if p.health and p.health.other_load_cores is not None]
    seen = f"other processes used up to {max(loads):.1f} cores, " if loads else ""
    return (
        f"stopped after its first {len(disturbed)} points, all disturbed: {seen}and its {threads} thread(s) "
        f"wait for time slices; {load_remedy(max(loads, default=0.0))}; --resume measures the rest"
    )


def search_candidates(search: Sequence[int]) -> List[int]:
    """The powers of two from LO to HI: the Ns a crossover search may measure."""
    lo, hi = search
    return [2**k for k in range(lo.bit_length() - 1, hi.bit_length())]


def _bisect_every_group(
    job: BenchmarkJob, sweep: Set[str], measure: Callable[[int, Dict[str, Any]], PointResult]
) -> None:
    for params in job.sweep.param_grid():
        if point_key(job.sweep.n_values[-1], params) in sweep:
            bisect(list(job.sweep.n_values), lambda n, params=params: measure(n, params))


def bisect(candidates: Sequence[int], measure: Callable[[int], PointResult]) -> None:
    """Find a group's crossover over `candidates` (increasing Ns), assuming that fusing that wins
    at some N wins at every larger one: the largest N first (no win there: it never crosses),
    then the smallest, then halving the range between the largest N that does not win and the
    smallest that does. `measure(n)` measures a point, or gives it back where it is known, so
    a search that a confirmation disturbed continues from what it knows. About log2 of the
    candidates are measured."""
    if not measure(candidates[-1]).fused_wins:
        return
    if measure(candidates[0]).fused_wins:
        return
    below, above = 0, len(candidates) - 1  # below: not fused; above: fused
    while above - below > 1:
        middle = (below + above) // 2
        if measure(candidates[middle]).fused_wins:
            above = middle
        else:
            below = middle


def check_runnable(job: BenchmarkJob, settings: RunSettings) -> None:
    """A clear error, before any point is measured, for a job these settings cannot run."""
    if job.random and settings.compile != "none":
        raise WideTesseraError(
            f"{job.op} draws random numbers, which compiled code draws its own way, so a compiled run could not "
            f"be checked; run it uncompiled (compile 'none', --compile none; got {settings.compile!r})"
        )
    if settings.mode == "backward" and settings.compile != "none":
        raise WideTesseraError(f"--compile {settings.compile} with --mode backward: {BACKWARD_NOT_COMPILED}")
    if settings.isolate:
        check_picklable(job)
    if settings.energy:
        why = energy_unavailable(settings.device)
        if why is not None:
            raise WideTesseraError(f"energy=True (--energy) cannot be measured: {why}")


def _points(
    job: BenchmarkJob, settings: RunSettings, skip: Set[str], facts: bool = True
) -> Generator[PointResult, None, None]:
    if settings.isolate:
        return iter_points_isolated(job, settings, skip, facts)
    return iter_points(job, settings, skip=skip, facts=facts)


def _build_result(
    job: BenchmarkJob,
    settings: RunSettings,
    points: List[PointResult],
    duration_s: float,
    complete: bool,
    peaks: Optional[Peaks],
    runs: List[Manifest],
    stopped: Optional[str],
) -> BenchmarkResult:
    return analysis.result_of(
        points,
        stopped=stopped,
        op=job.op,
        strategies=list(job.strategies),
        environment=capture_environment(settings.device),
        timer=timer_name(settings.device, settings.timing),
        settings=dataclasses.replace(settings, preset=job.preset),
        duration_s=duration_s,
        memory_method=memory_method(settings.device),
        complete=complete,
        peaks=peaks,
        runs=runs,
    )


def _progress(point: PointResult) -> str:
    where = f"N={point.n} {params_text(point.params)}"
    if "point" in point.failures:
        return f"{where}: {point.failures['point']}"
    bad = [s for s, ok in point.correct.items() if not ok]
    flag = f"  FAILED: {', '.join(bad)}" if bad else ""
    best = point.best_strategy
    if best is None:
        return f"{where}: no correct strategy{flag}"
    return f"{where}: {best} {point.speedups[best]:.2f}x ({point.verdicts[best]}){flag}"


def _confirmation_progress(point: PointResult) -> str:
    where = f"N={point.n} {params_text(point.params)}"
    if point.unstable:
        return f"{where}: UNSTABLE: first pass {analysis.first_verdict(point)}, now {point.confirmation.winner}"
    return f"{where}: confirmed {point.winner}"
