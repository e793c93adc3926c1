"""Walks a job's sweep: build N models and inputs, check every strategy, time baseline and strategies.

Nothing that goes wrong at a point stops the sweep: an exception, a stage that
overruns its limit, or a point over the memory budget becomes a `Failure` in
the result, and the next point runs.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

import torch

from .correctness import Check, check_outputs, tolerance
from .environment import capture_environment
from .job import DTYPES, BenchmarkJob
from .memory import memory_method, peak_memory
from .schema import BenchmarkResult, Failure, PointResult, params_text
from .stages import StageObserver, StageTimeout, StageTimeouts, stage_limit
from .stats import TimingStats
from .timing import TimedFunctionError, TimingConfig, measure_paired, timer_name

__all__ = ["run", "job_points", "iter_points", "build_result", "point_key", "progress", "RunSettings"]


class RunSettings:
    """How to run a job's points; shared by the in-process runner and the isolated worker."""

    def __init__(
        self,
        device: str = "cpu",
        seed: int = 0,
        timing: Optional[TimingConfig] = None,
        timeouts: Optional[StageTimeouts] = None,
        memory_budget: Optional[int] = None,
    ):
        self.device, self.seed = device, seed
        self.timing = timing or TimingConfig()
        self.timeouts = timeouts or StageTimeouts()
        self.memory_budget = memory_budget


def point_key(n: int, params: Dict[str, Any]) -> str:
    """A point's identity across runs, for --resume."""
    return json.dumps([n, params], sort_keys=True)


def run(
    job: BenchmarkJob,
    device: str = "cpu",
    verbose: bool = True,
    seed: int = 0,
    timing: Optional[TimingConfig] = None,
    timeouts: Optional[StageTimeouts] = None,
    memory_budget: Optional[int] = None,
    isolate: bool = False,
) -> BenchmarkResult:
    """Run every point of `job` on `device` (in a worker process with `isolate`) and analyse the timings."""
    started = time.perf_counter()
    settings = RunSettings(device, seed, timing, timeouts, memory_budget)
    points = []
    for point in job_points(job, settings, isolate):
        points.append(point)
        if verbose:
            progress(job.op, point, len(points), job.sweep.n_points())
    return build_result(job, settings, points, time.perf_counter() - started)


def job_points(
    job: BenchmarkJob, settings: RunSettings, isolate: bool = False, skip: Optional[Set[str]] = None
) -> Iterator[PointResult]:
    """The job's points as they are measured, in this process or in isolated workers."""
    if isolate:
        from .isolation import iter_points_isolated

        return iter_points_isolated(job, settings, skip)
    return iter_points(job, settings, skip=skip)


def build_result(
    job: BenchmarkJob, settings: RunSettings, points: List[PointResult], duration_s: float, complete: bool = True
) -> BenchmarkResult:
    return BenchmarkResult.from_points(
        points,
        op=job.op,
        preset=job.preset,
        strategies=list(job.strategies),
        environment=capture_environment(settings.device),
        timer=timer_name(settings.device, settings.timing),
        timing=settings.timing,
        seed=settings.seed,
        duration_s=duration_s,
        memory_method=memory_method(settings.device),
        complete=complete,
    )


def iter_points(
    job: BenchmarkJob,
    settings: RunSettings,
    start: int = 0,
    skip: Optional[Set[str]] = None,
    excluded: Optional[Dict[str, Failure]] = None,
    observer: Optional[Callable[[int, str, Optional[str], float], None]] = None,
) -> Iterator[PointResult]:
    """Measure the sweep's points from index `start`, leaving out those whose key is in `skip`.

    `excluded` holds strategies already known to fail at point `start` (the isolated
    runner's record of a crash): they are not run again, and their failures are kept.
    `observer(index, stage, strategy, limit)` hears of each stage as it starts.
    """
    skip = skip or set()
    # The profiler's first start in a process takes about a second (CPU): pay it here,
    # outside every stage's time limit.
    peak_memory(lambda: None, settings.device)
    with torch.no_grad():
        for index, (n, params) in enumerate(job.sweep.points()):
            if index < start or point_key(n, params) in skip:
                continue
            known = dict(excluded or {}) if index == start else {}
            yield _measure_point(
                job, n, params, settings, known, None if observer is None else partial(observer, index)
            )


def _measure_point(
    job: BenchmarkJob,
    n: int,
    params: Dict[str, Any],
    settings: RunSettings,
    failures: Dict[str, Failure],
    observer: Optional[StageObserver],
) -> PointResult:
    device, timeouts = settings.device, settings.timeouts
    dtype = DTYPES[params.get("dtype", "float32")]

    def stage(name: str, strategy: Optional[str] = None) -> Any:
        return stage_limit(name, timeouts, strategy, observer)

    try:
        with stage("setup"):
            over = _over_budget(job, n, params, dtype, settings)
            if over is not None:
                return PointResult.failed(n, params, {"point": over})
            # Seeded per point, so a point's models and inputs do not depend on which points ran before it.
            torch.manual_seed(settings.seed)
            modules = [job.model_factory(**params).to(device=device, dtype=dtype).eval() for _ in range(n)]
            inputs = [x.to(device=device, dtype=dtype) for x in job.input_factory(n, **params)]
    except Exception as e:
        return PointResult.failed(n, params, {"point": _failure("setup", e)})

    def baseline() -> List[torch.Tensor]:
        return [m(x) for m, x in zip(modules, inputs)]

    try:
        with stage("check", "baseline"):
            reference, baseline_peak = peak_memory(baseline, device)
    except Exception as e:
        return PointResult.failed(n, params, {"point": _failure("check", e)})

    tol = tolerance(dtype, device)
    checks: Dict[str, Check] = {}
    peaks = {"baseline": baseline_peak}
    timed: Dict[str, Callable[[], object]] = {"baseline": baseline}
    for strategy in job.strategies:
        if strategy in failures:
            continue
        try:
            with stage("check", strategy):
                wide = job.wide_factory(modules, strategy)
                packed = wide.pack(inputs)
                output, peaks[strategy] = peak_memory(partial(wide, packed), device)
                checks[strategy] = check_outputs(wide.unpack(output), reference, tol)
        except Exception as e:  # a broken strategy is a result to report, not a reason to stop the sweep
            failures[strategy] = _failure("check", e)
            _release_memory(device)
            continue
        if checks[strategy].correct:
            timed[strategy] = lambda wide=wide, packed=packed: wide(packed)

    stats = _measure_until_healthy(timed, settings, failures, stage)
    return PointResult.from_measurements(n, params, stats, checks, settings.seed, peaks, failures)


def _measure_until_healthy(
    timed: Dict[str, Callable[[], object]], settings: RunSettings, failures: Dict[str, Failure], stage: Any
) -> Dict[str, TimingStats]:
    """Time the functions together; one that fails is recorded and the rest are timed again without it."""
    while "baseline" in timed:
        try:
            return measure_paired(timed, settings.device, settings.timing, stage=stage)
        except TimedFunctionError as e:
            culprit = "point" if e.name == "baseline" else e.name
            phase = e.error.stage if isinstance(e.error, StageTimeout) else "measure"
            failures[culprit] = _failure(phase, e.error)
            del timed[e.name]
            _release_memory(settings.device)
    return {}


def _failure(stage: str, error: BaseException) -> Failure:
    if isinstance(error, StageTimeout):
        return Failure(error.stage, "timeout", "Timeout", str(error), error.elapsed_s, error.limit_s)
    return Failure(stage, "error", type(error).__name__, str(error))


def _release_memory(device: str) -> None:
    # After an out-of-memory error the failed strategy's tensors are garbage; free them
    # before the next strategy needs the room.
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _over_budget(
    job: BenchmarkJob, n: int, params: Dict[str, Any], dtype: torch.dtype, settings: RunSettings
) -> Optional[Failure]:
    """A 'skipped' failure if the point's estimated footprint exceeds the memory budget.

    The estimate, from one model and one input on the CPU: N times (weights twice, for
    the models and the wide copy; input twice, separate and packed; output twice,
    reference and wide).
    """
    if settings.memory_budget is None:
        return None
    model = job.model_factory(**params).to(dtype=dtype)
    x = job.input_factory(1, **params)[0].to(dtype=dtype)
    with torch.no_grad():
        y = model.eval()(x)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    estimate = n * 2 * (weights + x.numel() * x.element_size() + y.numel() * y.element_size())
    if estimate <= settings.memory_budget:
        return None
    return Failure(
        "setup",
        "skipped",
        "MemoryBudget",
        f"estimated footprint {estimate / 2**20:.1f} MiB exceeds the memory budget {settings.memory_budget / 2**20:.1f} MiB",
    )


def progress(op: str, point: PointResult, done: int, total: int) -> None:
    params = params_text(point.params)
    if "point" in point.failures:
        status = str(point.failures["point"])
    elif point.best_speedup is None:
        status = "no correct strategy"
    else:
        status = f"{point.best_strategy} {point.best_speedup:.2f}x ({point.verdicts[point.best_strategy]})"
    bad = [s for s, ok in point.correct.items() if not ok]
    flag = f"  FAILED: {', '.join(bad)}" if bad else ""
    print(f"[{op}] {done}/{total} N={point.n} {params}: {status}{flag}", file=sys.stderr, flush=True)
