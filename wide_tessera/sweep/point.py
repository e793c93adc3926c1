"""Measure one point of a sweep: build N models and inputs, check every strategy, time baseline and strategies.

Nothing that goes wrong at a point escapes it: an exception, a stage that
overruns its limit, or a point over the memory budget becomes a `Failure` in
the point's result. The in-process runner and the isolated worker both measure
points here.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Generator, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from ..core import trees
from ..core.capabilities import unmet_need
from ..core.correctness import (
    Check,
    check_outputs,
    fallback_note,
    merge_checks,
    nonfinite_reference,
    parameters_differ,
    shares_memory,
    tolerance,
    vacuous_reference,
)
from ..core.errors import NotApplicable
from ..core.job import DTYPES, BenchmarkJob, group_key, point_key
from ..core.roles import BASELINE, CONTROLS
from ..core.seeding import seeded
from ..measurement import modes
from ..measurement.controls import OPTIMIZER_CONTROLS, GraphedLoop, compiled, control_unavailable
from ..measurement.energy import measure_energy
from ..measurement.launches import launches_and_peak
from ..measurement.modes import TRAINING_MODES, Side
from ..measurement.recipe import Recipe
from ..measurement.settings import RunSettings
from ..measurement.stages import StageObserver, stage_limit
from ..measurement.timing import PairedTimings, once_s
from ..measurement.traces import trace_name, write_traces
from ..results import analysis
from ..results.decisions import level_of
from ..results.schema import Failure, PointResult
from .budget import over_budget
from .failures import failure_of, release_memory, unavailable
from .sampling import TimeBank, measure_until_healthy

__all__ = ["iter_points", "INPUT_DRAWS"]

# Each strategy is checked on this many independent input draws: one draw can hide a
# strategy that is right only for some inputs (KernelBench runs several trials).
INPUT_DRAWS = 2


def iter_points(
    job: BenchmarkJob,
    settings: RunSettings,
    start: int = 0,
    skip: Optional[Set[str]] = None,
    excluded: Optional[Dict[str, Failure]] = None,
    observer: Optional[Callable[[int, str, Optional[str], float], None]] = None,
    on_function: Optional[Callable[[str], None]] = None,
    facts: bool = True,
) -> Generator[PointResult, None, None]:
    """Measure the sweep's points from index `start`, leaving out those whose key is in `skip`.

    `excluded` holds strategies already known to fail at point `start` (the isolated
    runner's record of a crash): they are not run again, and their failures are kept.
    `observer(index, stage, strategy, limit)` hears of each stage as it starts, and
    `on_function(name)` of each function the timer is about to run. The controls are timed
    at each group's largest N, where their answer is given, unless settings.controls_at says
    'every'. Without `facts` (the confirmation pass, which re-measures decisions) the launches
    and memory peaks, which the first pass recorded, are not measured again.
    """
    skip = skip or set()
    largest: Dict[str, int] = {}
    for n, params in job.sweep.points():
        largest[group_key(params)] = max(n, largest.get(group_key(params), 0))
    bank = TimeBank()
    for index, (n, params) in enumerate(job.sweep.points()):
        if index < start or point_key(n, params) in skip:
            continue
        known = dict(excluded or {}) if index == start else {}
        controls = settings.controls and (settings.controls_at == "every" or n == largest[group_key(params)])
        # Grad mode is per thread, not per generator: a yield inside no_grad left the caller
        # without gradients while this generator waited, and for good where a Ctrl-C left it
        # unfinished (every later backward in the process failed: CI, 2026-11-27).
        # Each point draws (its models, inputs, dropout's masks) from the run's seed, so that it
        # does not depend on which points ran before it (the confirmation pass measures with a
        # seed of its own); the caller's generators are as they were after the run.
        with torch.no_grad(), seeded(settings.seed, settings.device):
            measurement = _PointMeasurement(
                job,
                n,
                params,
                settings,
                known,
                None if observer is None else partial(observer, index),
                on_function,
                controls,
                bank,
                facts,
            )
            result = measurement.run()
        yield result


def _clones(inputs: Sequence[Any]) -> List[Any]:
    return [trees.clone(x) for x in inputs]


Join = Callable[[List[Any]], Any]


@dataclass
class _Candidate:
    """One callable a point checks and then times: the compiled baseline, a strategy or a control.

    `join(modules)` builds the side's wide module from N models, for a training check (None for
    a loop over them); `check_side` is checked where the timed side cannot be (random models).
    """

    name: str
    side: Side
    join: Optional[Join] = None
    check_side: Optional[Side] = None


class _PointMeasurement:
    """One point, measured in named phases over explicit state (`run`):

    setup (N models, the input draws) -> reference (the separate calls' outputs, the baseline's
    timed call) -> candidates (each checked on every draw, its timed call kept when correct) ->
    timing (all timed calls together, until the decision settles) -> facts (launches, energy,
    traces). What a phase finds is an attribute the later phases read; what fails is a Failure
    in `failures`, never an exception out of the point.
    """

    def __init__(
        self,
        job: BenchmarkJob,
        n: int,
        params: Dict[str, Any],
        settings: RunSettings,
        failures: Dict[str, Failure],
        observer: Optional[StageObserver],
        on_function: Optional[Callable[[str], None]],
        controls: bool,
        bank: TimeBank,
        facts: bool,
    ):
        self.job, self.n, self.params, self.settings = job, n, params, settings
        self.failures, self.observer, self.on_function = failures, observer, on_function
        self.controls, self.bank, self.facts = controls, bank, facts
        self.device = settings.device
        self.dtype = DTYPES[params.get("dtype", "float32")]
        self.training = settings.mode in TRAINING_MODES
        # the train mode's per-model settings, drawn per point as a sweep draws them
        self.recipe = Recipe.drawn(n, settings.seed) if settings.mode == "train" else None
        self.compiling = settings.compile != "none"
        self.tol = tolerance(self.dtype, self.device)  # every candidate, every draw: one bound for the point
        self.modules: List[torch.nn.Module] = []
        self.draws: List[List[Any]] = []
        # Per draw: the separate calls' outputs, and whether they return their input (an identity:
        # only then may a strategy).
        self.references: List[Tuple[List[Any], bool]] = []
        self.weights: List[Any] = []  # training modes: per draw, what the loss weights each output by
        self.outcomes: List[modes.Outcome] = []  # training modes: per draw, what the N models' training call did
        self.checks: Dict[str, Check] = {}
        self.peaks: Dict[str, int] = {}
        self.first_call_s: Dict[str, float] = {}
        self.timed: Dict[str, Callable[[], object]] = {}

    def run(self) -> PointResult:
        failed = self.setup() or self.reference()
        if failed is not None:
            return failed
        if self.compiling or self.settings.controls:
            torch._dynamo.reset()  # each point compiles afresh: never silently eager past the recompile limit
        for candidate in self.candidates():
            call = self.checked(candidate)
            if call is not None:
                self.timed[candidate.name] = call
            elif candidate.name == BASELINE:
                return self.compiled_baseline_failed()
        self.checks.pop(BASELINE, None)  # the compiled loop's check: a condition of the point, not a verdict
        label = partial(trace_name, self.job.op, self.n, self.params)  # the NVTX ranges' names, on CUDA
        timings = measure_until_healthy(
            self.timed, self.settings, self.failures, self.stage, self.on_function, self.bank, label
        )
        return self.result(timings, label)

    def stage(self, name: str, strategy: Optional[str] = None) -> ContextManager[None]:
        return stage_limit(name, self.settings.timeouts, strategy, self.observer)

    # -- setup and reference -------------------------------------------------------------

    def setup(self) -> Optional[PointResult]:
        """The N models and the input draws; a failed point if they cannot be made."""
        job, params = self.job, self.params
        try:
            with self.stage("setup"):
                unfit = job.unfit_factory(self.n, **params)
                over = over_budget(job, self.n, params, self.dtype, self.settings)
                if unfit is not None:
                    over = Failure("setup", "skipped", "Unfit", unfit)
                if over is not None:
                    return analysis.failed_point(self.n, params, {"point": over})
                train = job.train or self.training
                self.modules = [
                    job.model_factory(**params).to(device=self.device, dtype=self.dtype).train(train)
                    for _ in range(self.n)
                ]
                self.draws = [
                    [trees.cast(x, self.device, self.dtype) for x in job.input_factory(self.n, **params)]
                    for _ in range(INPUT_DRAWS)
                ]
        except Exception as e:  # noqa: BLE001  a point whose setup fails is a result, not a reason to stop the sweep
            return analysis.failed_point(self.n, params, {"point": failure_of("setup", e)})
        return None

    def reference(self) -> Optional[PointResult]:
        """The separate calls on every draw, the references each candidate is checked against, and
        the baseline's timed call; a failed point if they cannot be judged or made.

        Calls in train mode update the models' running statistics: each call here starts from, and
        leaves, the models as they were built, from which each strategy is built and checked. Every
        call gets its own copy of the inputs: a model that changes its input in place (x += self.pos)
        must not change what the next strategy is checked on.
        """
        modules, draws = self.modules, self.draws
        try:
            with self.stage("check", BASELINE):
                # The first call (handles, workspaces: cuBLAS's 33 MiB on an H100) is not steady state.
                with modes.preserved(modules):
                    loop = partial(trees.call_each, modules, _clones(draws[0]))
                    self.first_call_s[BASELINE] = once_s(loop, self.device)
                for i, inputs in enumerate(draws):
                    given = _clones(inputs)
                    with modes.preserved(modules):
                        reference = self.reference_calls(given)
                    unjudgeable = nonfinite_reference(reference)
                    if unjudgeable is None and i == 0:
                        unjudgeable = vacuous_reference(reference, self.crossed_call(inputs))
                    if unjudgeable is not None:
                        failure = Failure("check", "error", "Unjudgeable", unjudgeable)
                        return analysis.failed_point(self.n, self.params, {"point": failure})
                    returns_input = any(
                        shares_memory(o, trees.tensors(x))
                        for out, x in zip(reference, given)
                        for o in trees.tensors(out)
                    )
                    self.references.append((reference, returns_input))
                    if self.training:
                        self.weights.append(modes.grad_weights(reference, self.settings.seed + i))
                        side = Side(self.reference_calls, list, list, modules, recipe=self.recipe)
                        outcome = modes.outcome(self.settings.mode, side, _clones(inputs), self.weights[i], _call)
                        if outcome.trained is not None:  # how far training itself carries a rounding difference
                            again = modes.outcome("train", side, _clones(inputs), self.weights[i], _call, twin=True)
                            outcome.twin = again.trained
                        self.outcomes.append(outcome)
                self.timed[BASELINE] = self.timed_of(self.loop_side())
        except Exception as e:  # noqa: BLE001  a point whose baseline fails is a result, not a reason to stop the sweep
            return analysis.failed_point(self.n, self.params, {"point": failure_of("check", e)})
        return None

    def seeded(self, call: Callable[[], Any]) -> Any:
        """`call()`, from the generator state of the point's seed where the models draw random numbers
        (BenchmarkJob.random): each model's call, and the wide call, draw the same numbers."""
        if not self.job.random:
            return call()
        with seeded(self.settings.seed, self.device):
            return call()

    def reference_calls(self, inputs: Sequence[Any], models: Optional[Sequence[torch.nn.Module]] = None) -> List[Any]:
        # Random models: every call starts from the same generator state, as the checked
        # wide call does (see BenchmarkJob.random), so each model draws what the wide call drew.
        pairs = zip(self.modules if models is None else models, inputs)
        return [self.seeded(partial(trees.call, m, x)) for m, x in pairs]

    def crossed_call(self, inputs: Sequence[Any]) -> Optional[Any]:
        """Model 0 on model 1's input, where their parameters differ (else None): for vacuous_reference."""
        modules = self.modules
        if self.n < 2 or not parameters_differ(modules[0], modules[1]):
            return None
        with modes.preserved(modules), torch.no_grad():
            return self.seeded(partial(trees.call, modules[0], trees.clone(inputs[1])))

    def loop_side(self, compile_mode: str = "none", optimizer: Optional[str] = None) -> Side:
        """N separate calls to time (train_step: stepped by N default optimizers, or by one
        `optimizer` over all N models). In the training modes each loop has models of its own, as
        the models were built: its optimizer steps them, and a backward-mode forward recorded on
        them must not see another side's check restore their running statistics."""
        models = [copy.deepcopy(m) for m in self.modules] if self.training else self.modules
        loop = partial(trees.call_each, models)
        forward = loop if compile_mode == "none" else compiled(loop, compile_mode)
        return Side(forward, list, list, models, optimizer, recipe=self.recipe)

    def timed_of(self, side: Side) -> Callable[[], object]:
        weights = self.weights[0] if self.weights else []
        writes_input = any(o.input_written for o in self.outcomes)  # the models write their input in place
        return modes.timed_call(self.settings.mode, side, _clones(self.draws[0]), weights, writes_input)

    # -- candidates ------------------------------------------------------------------------

    def candidates(self) -> Iterator[_Candidate]:
        """The compiled baseline (when compiling: the eager loop stays the reference it is checked
        against), every strategy that can be built here, and the controls asked for."""
        if self.compiling:
            yield _Candidate(BASELINE, self.loop_side(self.settings.compile))
        for strategy in self.job.strategies:
            candidate = None if strategy in self.failures else self.strategy(strategy)
            if candidate is not None:
                yield candidate
        if self.controls:
            yield from self.control_candidates()

    def strategy(self, strategy: str) -> Optional[_Candidate]:
        """The strategy's wide module of the N models; None, with its failure recorded, where it
        cannot apply here or cannot be built."""
        job, settings = self.job, self.settings
        reason = unmet_need(job.strategy_needs.get(strategy), self.device, self.dtype, self.params, self.compiling)
        if reason is not None:
            self.failures[strategy] = unavailable(strategy, reason)
            return None
        try:
            with self.stage("check", strategy):
                wide = job.wide_factory(self.modules, strategy)
                seeded_wide = job.seeded_check_factory and job.seeded_check_factory(self.modules, strategy)
        except NotApplicable as e:
            self.failures[strategy] = unavailable(strategy, e)
            return None
        except Exception as e:  # noqa: BLE001  a strategy that cannot be built is a result to report
            self.failures[strategy] = failure_of("check", e)
            return None
        side = _wide_side(wide, compiled(wide, settings.compile) if self.compiling else wide, self.recipe)
        check_side = seeded_wide and _wide_side(seeded_wide, seeded_wide, self.recipe)
        return _Candidate(strategy, side, partial(_join, job.wide_factory, strategy), check_side)

    def control_candidates(self) -> Iterator[_Candidate]:
        """The controls that can run here (measurement.controls)."""
        settings = self.settings
        for control in CONTROLS:
            if control_unavailable(
                control, self.device, settings.compile, settings.timing.cuda_graph, self.job.random, settings.mode
            ):
                continue
            if control in OPTIMIZER_CONTROLS:  # the loop as the baseline runs it, compiled or not
                side = self.loop_side(settings.compile, OPTIMIZER_CONTROLS[control])
                # the N separate calls themselves: checked drawing what the reference's calls drew, model by model
                same_draws = partial(self.reference_calls, models=side.modules)
                yield _Candidate(
                    control, side, check_side=replace(side, forward=same_draws) if self.job.random else None
                )
            elif control == "loop_compiled":
                yield _Candidate(control, self.loop_side("default"))
            else:
                yield _Candidate(control, _graphed_side(partial(trees.call_each, self.modules), self.draws[0]))

    def checked(self, candidate: _Candidate) -> Optional[Callable[[], object]]:
        """Check the candidate on every draw; its timed call on draw 0 when correct, else None
        (its verdict in `checks`, or its failure in `failures`).

        The first call (compilation, autotuning, handles) is timed apart; the memory peak is
        taken after the timing (`result`): on an H100 a Triton strategy's autotuning showed as a
        256 MiB peak.
        """
        name, side = candidate.name, candidate.side
        try:
            with self.stage("check", name), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with modes.preserved(side.modules):
                    self.first_call_s[name] = once_s(self.timed_of(side), self.device)
                checked_side = candidate.check_side or side
                draw_checks = [
                    self.check_draw(checked_side, candidate.join, i, _clones(x)) for i, x in enumerate(self.draws)
                ]
            messages = list(dict.fromkeys(str(w.message) for w in caught))
            ran = getattr(side.modules[0], "what_ran", None) if side.wide else None
            self.checks[name] = replace(
                merge_checks(draw_checks, fallback_note(messages), messages), ran=ran and ran()
            )
            if not self.checks[name].correct:
                return None
            # left as the timed call leaves it: restoring could break a recorded forward
            with self.stage("check", name):
                return self.timed_of(side)
        except NotApplicable as e:  # found on its first call (surgery captures a model there)
            self.failures[name] = unavailable(name, e)
            return None
        except Exception as e:  # noqa: BLE001  a broken strategy is a result to report, not a reason to stop the sweep
            self.failures[name] = failure_of("check", e, name)
            release_memory(self.device)
            return None

    def check_draw(self, side: Side, join: Optional[Join], i: int, given: List[Any]) -> Check:
        """One draw's verdict on `side`: its N outputs (training modes: and gradients, state) against
        the separate calls'."""
        reference, returns_input = self.references[i]
        if self.training:
            got = modes.outcome(self.settings.mode, side, given, self.weights[i], self.seeded)
            return modes.compare(self.outcomes[i], got, self.modules, join, self.tol)
        x = side.pack(given)
        output = self.seeded(partial(side.forward, x))
        forbidden = [] if returns_input else trees.tensors([x, given])
        return check_outputs(side.unpack(output), reference, self.tol, forbidden)

    def compiled_baseline_failed(self) -> PointResult:
        check = self.checks.pop(BASELINE, None)
        failure = self.failures.pop(BASELINE, None) or Failure(
            "check",
            "error",
            "Incorrect",
            f"the compiled baseline differs from the eager calls: {check and check.error}",
        )
        return analysis.failed_point(self.n, self.params, {"point": failure}, peak_memory_bytes=self.peaks)

    # -- the result and its facts ----------------------------------------------------------

    def result(self, timings: Optional[PairedTimings], label: Callable[[str], str]) -> PointResult:
        """The point's result from its timings, with the facts measured after them: launches and
        memory peaks, energy and traces, each after the timings and never inside them."""
        launches = {}
        for name in timings.stats if timings is not None and self.facts else ():
            with self.stage("measure", name):  # after timing: every call counted has run many times already
                launches[name], self.peaks[name] = launches_and_peak(self.timed[name], self.device)
        point = analysis.measured_point(
            self.n,
            self.params,
            timings,
            self.checks,
            level_of(self.settings),
            self.peaks,
            self.failures,
            self.first_call_s,
            self.settings.regret,
        )
        point.launches, point.work = launches, self.job.work_factory(self.n, **self.params)
        if timings is not None:
            self.energy(point, timings)
            self.traces(point, timings, label)
        return point

    def energy(self, point: PointResult, timings: PairedTimings) -> None:
        if not self.settings.energy:
            return
        medians = {name: st.median_ms for name, st in timings.stats.items()}
        calls = {name: self.timed[name] for name in medians}
        try:
            with self.stage("measure"):
                cuda_graph = self.settings.timing.cuda_graph
                point.energy = measure_energy(calls, medians, self.device, cuda_graph, self.on_function)
        except Exception as e:  # noqa: BLE001  the timings stand without it; say why it is missing
            point.flags.append(f"no energy measured: {type(e).__name__}: {e}")

    def traces(self, point: PointResult, timings: PairedTimings, label: Callable[[str], str]) -> None:
        settings = self.settings
        if not settings.trace or (settings.trace_n is not None and self.n not in settings.trace_n):
            return
        try:
            with self.stage("measure"):
                calls = {name: self.timed[name] for name in timings.stats}
                point.traces = [str(path) for path in write_traces(calls, Path(settings.trace), label, self.device)]
        except Exception as e:  # noqa: BLE001  the timings stand without it; say why it is missing
            point.flags.append(f"no trace written: {type(e).__name__}: {e}")


def _wide_side(wide: Any, forward: Callable, recipe: Optional[Recipe]) -> Side:
    """The inputs packed into the wide module's layout, `forward` (the module, or it compiled) on them."""
    return Side(partial(trees.call, forward), wide.pack, wide.unpack, [wide], wide=True, recipe=recipe)


def _join(wide_factory: Callable[[List[Any], str], Any], strategy: str, modules: List[Any]) -> Any:
    """The strategy's wide module of `modules`: how a training check joins the models' gradients and state."""
    return wide_factory(modules, strategy)


def _call(call: Callable[[], Any]) -> Any:
    return call()


def _graphed_side(loop: Callable, capture_inputs: Sequence[torch.Tensor]) -> Side:
    """The loop captured on its first use (in the check stage, where a failure is recorded) over
    draw 0's inputs; each draw is then copied into the static inputs."""
    graphed: List[GraphedLoop] = []

    def load(given: List[torch.Tensor]) -> List[Any]:
        if not graphed:
            graphed.append(GraphedLoop(loop, capture_inputs))
        graphed[0].load(given)
        return graphed[0].inputs

    return Side(lambda _: graphed[0].replay(), load, list, [])
