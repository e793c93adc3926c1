"""Measure one point of a sweep: build N models and inputs, check every strategy, time baseline and strategies.

Nothing that goes wrong at a point escapes it: an exception, a stage that
overruns its limit, or a point over the memory budget becomes a `Failure` in
the point's result. The in-process runner and the isolated worker both measure
points here.
"""

from __future__ import annotations

import gc
import json
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set

import torch

from ..checks import check_bool, check_instance, check_seed
from ..errors import WideTesseraError
from . import analysis
from .correctness import (
    Check,
    check_outputs,
    fallback_note,
    merge_checks,
    nonfinite_reference,
    shares_memory,
    tolerance,
)
from .job import DTYPES, BenchmarkJob
from .memory import peak_memory
from .schema import Failure, PointResult
from .stages import StageObserver, StageTimeout, StageTimeouts, stage_limit
from .timing import PairedTimings, TimedFunctionError, TimingConfig, measure_paired

__all__ = ["RunSettings", "CONFIRM_MODES", "point_key", "iter_points", "INPUT_DRAWS"]

CONFIRM_MODES = ("deciding", "all", "none")
# Each strategy is checked on this many independent input draws: one draw can hide a
# strategy that is right only for some inputs (KernelBench runs several trials).
INPUT_DRAWS = 2


def default_timing() -> TimingConfig:
    """The timing settings of a run that names none; one place, so tests can shorten it."""
    return TimingConfig()


@dataclass(frozen=True)
class RunSettings:
    """How to run a job's points; one object, passed whole to the runner and the isolated worker.

    confirm: which points the confirmation pass measures again ('deciding', 'all', 'none').
    """

    device: str = "cpu"
    seed: int = 0
    timing: Optional[TimingConfig] = None
    timeouts: StageTimeouts = field(default_factory=StageTimeouts)
    memory_budget: Optional[int] = None
    isolate: bool = False
    confirm: str = "deciding"

    def __post_init__(self) -> None:
        if self.timing is None:
            object.__setattr__(self, "timing", default_timing())
        check_seed(self.seed)
        check_instance("timing", self.timing, TimingConfig)
        check_instance("timeouts", self.timeouts, StageTimeouts)
        check_bool("isolate", self.isolate)
        if self.confirm not in CONFIRM_MODES:
            raise WideTesseraError(f"confirm={self.confirm!r}: valid are {', '.join(CONFIRM_MODES)}")


def point_key(n: int, params: Dict[str, Any]) -> str:
    """A point's identity across runs and passes, for --resume and the confirmation pass."""
    return json.dumps([n, params], sort_keys=True)


def iter_points(
    job: BenchmarkJob,
    settings: RunSettings,
    start: int = 0,
    skip: Optional[Set[str]] = None,
    excluded: Optional[Dict[str, Failure]] = None,
    observer: Optional[Callable[[int, str, Optional[str], float], None]] = None,
    on_function: Optional[Callable[[str], None]] = None,
) -> Iterator[PointResult]:
    """Measure the sweep's points from index `start`, leaving out those whose key is in `skip`.

    `excluded` holds strategies already known to fail at point `start` (the isolated
    runner's record of a crash): they are not run again, and their failures are kept.
    `observer(index, stage, strategy, limit)` hears of each stage as it starts, and
    `on_function(name)` of each function the timer is about to run.
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
                job, n, params, settings, known, None if observer is None else partial(observer, index), on_function
            )


def _clones(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t.clone() for t in tensors]


def _measure_point(
    job: BenchmarkJob,
    n: int,
    params: Dict[str, Any],
    settings: RunSettings,
    failures: Dict[str, Failure],
    observer: Optional[StageObserver],
    on_function: Optional[Callable[[str], None]] = None,
) -> PointResult:
    device, timeouts = settings.device, settings.timeouts
    dtype = DTYPES[params.get("dtype", "float32")]

    def stage(name: str, strategy: Optional[str] = None) -> Any:
        return stage_limit(name, timeouts, strategy, observer)

    try:
        with stage("setup"):
            over = _over_budget(job, n, params, dtype, settings)
            if over is not None:
                return analysis.failed_point(n, params, {"point": over})
            # Seeded per point, so a point's models and inputs do not depend on which points
            # ran before it, and the confirmation pass rebuilds exactly the same point.
            torch.manual_seed(settings.seed)
            modules = [job.model_factory(**params).to(device=device, dtype=dtype).eval() for _ in range(n)]
            draws = [
                [x.to(device=device, dtype=dtype) for x in job.input_factory(n, **params)] for _ in range(INPUT_DRAWS)
            ]
    except Exception as e:
        return analysis.failed_point(n, params, {"point": _failure("setup", e)})

    # Every call below gets its own copy of the inputs: a model that changes its input in
    # place (x += self.pos) must not change what the next strategy is checked on.
    def separate_calls(inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return [m(x) for m, x in zip(modules, inputs)]

    try:
        with stage("check", "baseline"):
            references, baseline_peak = [], 0
            for i, inputs in enumerate(draws):
                given = _clones(inputs)
                if i == 0:
                    reference, baseline_peak = peak_memory(partial(separate_calls, given), device)
                else:
                    reference = separate_calls(given)
                unjudgeable = nonfinite_reference(reference)
                if unjudgeable is not None:
                    return analysis.failed_point(n, params, {"point": Failure("check", "error", "Unjudgeable", unjudgeable)})
                # The separate calls may return their input (an identity); only then may a strategy.
                returns_input = any(shares_memory(o, [x]) for o, x in zip(reference, given))
                references.append((reference, returns_input))
    except Exception as e:
        return analysis.failed_point(n, params, {"point": _failure("check", e)})

    tol = tolerance(dtype, device)
    checks: Dict[str, Check] = {}
    peaks = {"baseline": baseline_peak}
    baseline_inputs = _clones(draws[0])
    timed: Dict[str, Callable[[], object]] = {"baseline": partial(separate_calls, baseline_inputs)}
    for strategy in job.strategies:
        if strategy in failures:
            continue
        try:
            with stage("check", strategy), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wide = job.wide_factory(modules, strategy)
                draw_checks = []
                for i, (inputs, (reference, returns_input)) in enumerate(zip(draws, references)):
                    given = _clones(inputs)
                    packed = wide.pack(given)
                    if i == 0:
                        output, peaks[strategy] = peak_memory(partial(wide, packed), device)
                    else:
                        output = wide(packed)
                    forbidden = [] if returns_input else [packed, *given]
                    draw_checks.append(check_outputs(wide.unpack(output), reference, tol, forbidden))
            messages = list(dict.fromkeys(str(w.message) for w in caught))
            checks[strategy] = merge_checks(draw_checks, fallback_note(messages), messages)
        except Exception as e:  # a broken strategy is a result to report, not a reason to stop the sweep
            failures[strategy] = _failure("check", e)
            _release_memory(device)
            continue
        if checks[strategy].correct:
            packed = wide.pack(_clones(draws[0]))
            timed[strategy] = partial(wide, packed)

    timings = _measure_until_healthy(timed, settings, failures, stage, on_function)
    return analysis.measured_point(n, params, timings, checks, settings.seed, peaks, failures)


def _measure_until_healthy(
    timed: Dict[str, Callable[[], object]],
    settings: RunSettings,
    failures: Dict[str, Failure],
    stage: Any,
    on_function: Optional[Callable[[str], None]],
) -> Optional[PairedTimings]:
    """Time the functions together; one that fails is recorded and the rest are timed again without it."""
    while "baseline" in timed:
        try:
            return measure_paired(timed, settings.device, settings.timing, stage, on_function)
        except TimedFunctionError as e:
            culprit = "point" if e.name == "baseline" else e.name
            phase = e.error.stage if isinstance(e.error, StageTimeout) else "measure"
            failures[culprit] = _failure(phase, e.error)
            del timed[e.name]
            _release_memory(settings.device)
    return None


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
