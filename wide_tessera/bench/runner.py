"""Walks a job's sweep: build N models and inputs, check every strategy, time baseline and strategies."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .correctness import Check, check_outputs, tolerance
from .environment import capture_environment
from .job import DTYPES, BenchmarkJob
from .schema import BenchmarkResult, PointResult
from .stats import TimingStats
from .timing import TimingConfig, measure_paired

__all__ = ["run"]


def run(
    job: BenchmarkJob,
    device: str = "cpu",
    verbose: bool = True,
    seed: int = 0,
    timing: Optional[TimingConfig] = None,
) -> BenchmarkResult:
    """Run every point of `job` on `device` and analyse the timings."""
    started = time.perf_counter()
    timing = timing or TimingConfig()
    total = job.sweep.n_points()
    points: List[PointResult] = []
    with torch.no_grad():
        for params in job.sweep.param_grid():
            for n in job.sweep.n_values:
                point = _measure_point(job, n, params, device, seed, timing)
                points.append(point)
                if verbose:
                    _progress(job, point, len(points), total)
    return BenchmarkResult.from_points(
        points,
        op=job.op,
        preset=job.preset,
        strategies=list(job.strategies),
        environment=capture_environment(device),
        timer=points[0].stats["baseline"].timer,
        timing=timing,
        seed=seed,
        duration_s=time.perf_counter() - started,
    )


def _measure_point(
    job: BenchmarkJob, n: int, params: Dict[str, Any], device: str, seed: int, timing: TimingConfig
) -> PointResult:
    dtype = DTYPES[params.get("dtype", "float32")]
    # Seeded per point, so a point's models and inputs do not depend on which points ran before it.
    torch.manual_seed(seed)
    modules = [job.model_factory(**params).to(device=device, dtype=dtype).eval() for _ in range(n)]
    inputs = [x.to(device=device, dtype=dtype) for x in job.input_factory(n, **params)]
    reference = [m(x) for m, x in zip(modules, inputs)]
    tol = tolerance(dtype, device)

    checks: Dict[str, Check] = {}
    timed: Dict[str, Callable[[], object]] = {"baseline": lambda: [m(x) for m, x in zip(modules, inputs)]}
    for strategy in job.strategies:
        try:
            wide = job.wide_factory(modules, strategy)
            packed = wide.pack(inputs)
            checks[strategy] = check_outputs(wide.unpack(wide(packed)), reference, tol)
        except Exception as e:  # a broken strategy is a result to report, not a reason to stop the sweep
            checks[strategy] = Check(False, None, tol, f"{type(e).__name__}: {e}")
        if checks[strategy].correct:
            timed[strategy] = lambda wide=wide, packed=packed: wide(packed)

    # Interleaved rounds, so the speedups come from paired samples that saw the same machine state.
    stats: Dict[str, TimingStats] = measure_paired(timed, device, timing)
    return PointResult.from_measurements(n, params, stats, checks, seed)


def _progress(job: BenchmarkJob, point: PointResult, done: int, total: int) -> None:
    params = " ".join(f"{k}={v}" for k, v in point.params.items())
    best = (
        "no correct strategy"
        if point.best_speedup is None
        else f"{point.best_strategy} {point.best_speedup:.2f}x ({point.verdicts[point.best_strategy]})"
    )
    bad = [s for s, ok in point.correct.items() if not ok]
    flag = f"  INCORRECT: {', '.join(bad)}" if bad else ""
    print(f"[{job.op}] {done}/{total} N={point.n} {params}: {best}{flag}", file=sys.stderr, flush=True)
