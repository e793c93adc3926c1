"""Measure one point of a sweep: build N models and inputs, check every strategy, time baseline and strategies.

Nothing that goes wrong at a point escapes it: an exception, a stage that
overruns its limit, or a point over the memory budget becomes a `Failure` in
the point's result. The in-process runner and the isolated worker both measure
points here.
"""

from __future__ import annotations

import gc
import json
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from ..checks import check_bool, check_instance, check_seed
from ..errors import WideTesseraError
from . import analysis, trees
from .capabilities import unmet_need
from .controls import COMPILE_MODES, CONTROLS, GraphedLoop, compiled, control_unavailable
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
from .launches import count_launches
from .memory import peak_memory
from .schema import Failure, PointResult
from .stages import StageObserver, StageTimeout, StageTimeouts, stage_limit
from .timing import PairedTimings, TimedFunctionError, TimingConfig, measure_paired

__all__ = ["RunSettings", "CONFIRM_MODES", "COMPILE_MODES", "point_key", "iter_points", "INPUT_DRAWS"]

CONFIRM_MODES = ("deciding", "all", "none")
# Each strategy is checked on this many independent input draws: one draw can hide a
# strategy that is right only for some inputs (KernelBench runs several trials).
INPUT_DRAWS = 2


def default_timing() -> TimingConfig:
    """The timing settings of a run that names none; one place, so tests can shorten it."""
    return TimingConfig()


def default_controls() -> bool:
    """Whether a run that does not say times the controls; one place, so tests can leave them out."""
    return True


@dataclass(frozen=True)
class RunSettings:
    """How to run a job's points; one object, passed whole to the runner and the isolated worker.

    confirm: which points the confirmation pass measures again ('deciding', 'all', 'none').
    compile: torch.compile mode applied to the baseline and every strategy alike ('none' for eager).
    controls: time the controls (see `controls`) beside the strategies where they apply.
    roofline: measure the device's peaks (once, cached) and report each timing against them.
    """

    device: str = "cpu"
    seed: int = 0
    timing: Optional[TimingConfig] = None
    timeouts: StageTimeouts = field(default_factory=StageTimeouts)
    memory_budget: Optional[int] = None
    isolate: bool = False
    confirm: str = "deciding"
    compile: str = "none"
    controls: Optional[bool] = None
    roofline: bool = False

    def __post_init__(self) -> None:
        if self.timing is None:
            object.__setattr__(self, "timing", default_timing())
        if self.controls is None:
            object.__setattr__(self, "controls", default_controls())
        check_bool("controls", self.controls)
        check_bool("roofline", self.roofline)
        if self.compile not in COMPILE_MODES:
            raise WideTesseraError(f"compile={self.compile!r}: valid are {', '.join(COMPILE_MODES)}")
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


def _clones(inputs: Sequence[Any]) -> List[Any]:
    return [trees.clone(x) for x in inputs]


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
            modules = [job.model_factory(**params).to(device=device, dtype=dtype).train(job.train) for _ in range(n)]
            draws = [
                [trees.cast(x, device, dtype) for x in job.input_factory(n, **params)] for _ in range(INPUT_DRAWS)
            ]
    except Exception as e:
        return analysis.failed_point(n, params, {"point": _failure("setup", e)})

    # Every call below gets its own copy of the inputs: a model that changes its input in
    # place (x += self.pos) must not change what the next strategy is checked on.
    def separate_calls(inputs: Sequence[Any]) -> List[Any]:
        return [trees.call(m, x) for m, x in zip(modules, inputs)]

    def reference_calls(inputs: Sequence[Any]) -> List[Any]:
        # Random models: every call starts from the same generator state, as the checked
        # wide call does (see BenchmarkJob.random), so each model draws what the wide call drew.
        return [_seeded(partial(trees.call, m, x), settings.seed, job.random) for m, x in zip(modules, inputs)]

    try:
        with stage("check", "baseline"):
            references, baseline_peak = [], 0
            # The first call (handles, workspaces: cuBLAS's 33 MiB on an H100) is not steady state.
            first_call_s = {"baseline": _first_call_s(partial(separate_calls, _clones(draws[0])), device)}
            for i, inputs in enumerate(draws):
                given = _clones(inputs)
                if i == 0:
                    reference, baseline_peak = peak_memory(partial(reference_calls, given), device)
                else:
                    reference = reference_calls(given)
                unjudgeable = nonfinite_reference(reference)
                if unjudgeable is not None:
                    return analysis.failed_point(n, params, {"point": Failure("check", "error", "Unjudgeable", unjudgeable)})
                # The separate calls may return their input (an identity); only then may a strategy.
                returns_input = any(
                    shares_memory(o, trees.tensors(x)) for out, x in zip(reference, given) for o in trees.tensors(out)
                )
                references.append((reference, returns_input))
    except Exception as e:
        return analysis.failed_point(n, params, {"point": _failure("check", e)})

    tol = tolerance(dtype, device)
    checks: Dict[str, Check] = {}
    peaks = {"baseline": baseline_peak}
    compiling = settings.compile != "none"
    if compiling or settings.controls:
        torch._dynamo.reset()  # each point compiles afresh: never silently eager past the recompile limit

    def checked(name: str, prepare: Prepare, timed_prepare: Optional[Prepare] = None) -> Optional[Callable[[], object]]:
        """Check `name` on every draw; its timed call on draw 0 when correct, else None.

        `prepare(inputs)` -> (call, unpack, own inputs): the call to check and time, what
        turns its result into N outputs, and the inputs it made (none may be returned);
        `timed_prepare` the call to time where it is not the checked one (random models).
        The first call (compilation, autotuning, handles) is timed apart and kept out of
        the memory peak: on an H100 a Triton strategy's autotuning showed as a 256 MiB peak.
        """
        try:
            with stage("check", name), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first_call_s[name] = _first_call_s((timed_prepare or prepare)(_clones(draws[0]))[0], device)
                draw_checks = []
                for i, (inputs, (reference, returns_input)) in enumerate(zip(draws, references)):
                    given = _clones(inputs)
                    call, unpack, own = prepare(given)
                    call = partial(_seeded, call, settings.seed, job.random)
                    if i == 0:
                        output, peaks[name] = peak_memory(call, device)
                    else:
                        output = call()
                    forbidden = [] if returns_input else trees.tensors([own, given])
                    draw_checks.append(check_outputs(unpack(output), reference, tol, forbidden))
            messages = list(dict.fromkeys(str(w.message) for w in caught))
            checks[name] = merge_checks(draw_checks, fallback_note(messages), messages)
        except Exception as e:  # a broken strategy is a result to report, not a reason to stop the sweep
            failures[name] = _failure("check", e)
            _release_memory(device)
            return None
        return (timed_prepare or prepare)(_clones(draws[0]))[0] if checks[name].correct else None

    def loop_prepare(loop: Callable) -> Prepare:
        return lambda given: (partial(loop, given), list, [])

    timed: Dict[str, Callable[[], object]] = {"baseline": partial(separate_calls, _clones(draws[0]))}
    if compiling:  # the compiled loop is the baseline; the eager one stays the reference it is checked against
        baseline = checked("baseline", loop_prepare(compiled(separate_calls, settings.compile)))
        check = checks.pop("baseline", None)
        if baseline is None:
            failure = failures.pop("baseline", None) or Failure(
                "check", "error", "Incorrect", f"the compiled baseline differs from the eager calls: {check.error}"
            )
            return analysis.failed_point(n, params, {"point": failure}, peak_memory_bytes=peaks)
        timed["baseline"] = baseline
    for strategy in job.strategies:
        if strategy in failures:
            continue
        reason = unmet_need(job.strategy_needs.get(strategy), device, dtype, params, compiling)
        if reason is not None:
            failures[strategy] = Failure("setup", "skipped", "Unavailable", f"{strategy}: {reason}")
            continue
        try:
            with stage("check", strategy):
                wide = job.wide_factory(modules, strategy)
                seeded = job.seeded_check_factory and job.seeded_check_factory(modules, strategy)
        except Exception as e:
            failures[strategy] = _failure("check", e)
            continue
        forward = compiled(wide, settings.compile) if compiling else wide
        timed_prepare = _wide_prepare(wide, forward)
        call = checked(strategy, _wide_prepare(seeded, seeded), timed_prepare) if seeded else checked(strategy, timed_prepare)
        if call is not None:
            timed[strategy] = call
    for control in CONTROLS if settings.controls else ():
        if control_unavailable(control, device, settings.compile, settings.timing.cuda_graph, job.random) is not None:
            continue
        if control == "loop_compiled":
            call = checked(control, loop_prepare(compiled(separate_calls, "default")))
        else:
            call = checked(control, _graphed_prepare(separate_calls, draws[0]))
        if call is not None:
            timed[control] = call

    timings = _measure_until_healthy(timed, settings, failures, stage, on_function)
    launches = {}
    for name in timings.stats if timings is not None else ():
        with stage("measure", name):  # after timing: every call counted has run many times already
            launches[name] = count_launches(timed[name], device)
    point = analysis.measured_point(n, params, timings, checks, settings.seed, peaks, failures, first_call_s)
    point.launches, point.work = launches, job.work_factory(n, **params)
    return point


# prepare(inputs) -> (the call, what turns its result into N outputs, the inputs it made)
Prepare = Callable[[List[Any]], Tuple[Callable[[], object], Callable[[Any], Sequence[Any]], List[Any]]]


def _wide_prepare(wide: Any, forward: Callable) -> Prepare:
    """The inputs packed into the wide module's layout, `forward` (the module, or it compiled) on them."""

    def prepare(given: List[Any]) -> Any:
        packed = wide.pack(given)
        return partial(trees.call, forward, packed), wide.unpack, [packed]

    return prepare


def _seeded(call: Callable[[], Any], seed: int, random: bool) -> Any:
    """`call()`, from the generator state `seed` when the models draw random numbers."""
    if random:
        torch.manual_seed(seed)
    return call()


def _graphed_prepare(loop: Callable, capture_inputs: Sequence[torch.Tensor]) -> Prepare:
    """The loop captured on its first use (in the check stage, where a failure is recorded) over
    draw 0's inputs; each draw is then copied into the static inputs."""
    graphed: List[GraphedLoop] = []

    def prepare(given: List[torch.Tensor]) -> Any:
        if not graphed:
            graphed.append(GraphedLoop(loop, capture_inputs))
        graphed[0].load(given)
        return graphed[0].replay, list, graphed[0].inputs

    return prepare


def _first_call_s(call: Callable[[], object], device: str) -> float:
    """Seconds the first call took: for a compiled callable, its compilation."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    call()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


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
    x = trees.cast(job.input_factory(1, **params)[0], "cpu", dtype)
    with torch.no_grad():
        y = trees.call(model.train(job.train), x)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    estimate = n * 2 * (weights + sum(t.numel() * t.element_size() for t in trees.tensors([x, y])))
    if estimate <= settings.memory_budget:
        return None
    return Failure(
        "setup",
        "skipped",
        "MemoryBudget",
        f"estimated footprint {estimate / 2**20:.1f} MiB exceeds the memory budget {settings.memory_budget / 2**20:.1f} MiB",
    )
