"""The ask-and-tell scheduler: trials asked one at a time, grouped by shape, each group trained
when it is full."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Type, Union

import torch
from torch import nn

from ...core import trees
from ...core.errors import MissingDependency, WideTesseraError
from ...core.seeding import forked, seeded
from ...core.user_input import check_number
from ...dispatch.table import default_table_path
from ...measurement.settings import resolve_device
from ...ops.alike import layout_of
from ...widen.capture import exports_kept
from ...widen.rates import rate_settings
from .group import Plan, train_group
from .host import optuna
from .sizing import Sizing, probed, size_groups, step_seconds
from .summary import GroupRecord, StudySummary, labels, shape_params
from .tell import Callback, Teller, checked_contract
from .training import Training
from .trial import Draws, Member, build_model, suggested, trial_seed


def optimize(
    study: Any,
    suggest: Callable[[Any], Dict[str, Any]],
    build: Callable[[Dict[str, Any]], nn.Module],
    training: Training,
    n_trials: int,
    group_size: Optional[int] = None,
    table: Union[None, str, Path] = None,
    strategy: Optional[str] = None,
    device: str = "cpu",
    progress: bool = True,
    timeout: Optional[float] = None,
    catch: Tuple[Type[Exception], ...] = (),
    callbacks: Optional[Iterable[Callback]] = None,
    gc_after_trial: bool = False,
    sizing_share: float = 0.1,
) -> StudySummary:
    """Run `n_trials` trials of `study`, each group of trials whose models share a shape trained
    as one fused model (see the module's docstring). suggest(trial) -> the trial's parameters
    (Optuna's define-by-run: trial.suggest_float(...)); build(params) -> its model; training: how
    it trains. group_size: trials per group (None: the largest N the dispatch `table` says fuses
    a training step, measured here where it says nothing, capped by memory). strategy: the fused
    strategy every group runs (fuse(strategy=...)); None: with group_size K, the strategy the
    table names at N=K whatever its verdict (measured here where it names none; where none trains
    K models correctly, a DispatchWarning says so and the groups run as a loop); without, fuse()'s
    choice at the group's N. timeout, catch, callbacks, gc_after_trial: study.optimize's (no trial
    is asked after `timeout` seconds, the groups asked train to the end; a trial that raises fails
    alone, its group going on without it, and the error is raised once the trials asked are told,
    unless `catch` names its type). sizing_share: the most probing a shape the table decides nothing
    for may cost, as a share of the study's time so far and of its first group's steps left, at
    most of its estimated sequential time (probe.Probe; 0: the table's or the given size alone)."""
    _check_arguments(study, n_trials, group_size, training)
    device = resolve_device(device)
    timeout, catch, listed = checked_contract(timeout, catch, callbacks)
    share = check_number("sizing_share", sizing_share, 0.0, 1.0, low_ok=True)
    teller = Teller(study, catch, listed, gc_after_trial)
    table_path = Path(table) if table is not None else default_table_path()
    run = _Scheduler(teller, suggest, build, training, n_trials, table_path, device, timeout, progress)
    # every draw the study makes (sizing, timing, training) on a fork: the caller's generator stays
    # as it was; a surgery rebuilt for a probe's switch or a repack copies the export it made before
    with forked(device), exports_kept():
        try:
            while run.asking() or run.pending:
                ready = next((k for k, ms in run.pending.items() if len(ms) >= run.size(k)), None)
                if ready is None and run.asking():
                    run.ask(group_size, strategy, share)
                else:
                    run.train(ready if ready is not None else next(iter(run.pending)))
            if teller.raised is not None:
                raise teller.raised
        except BaseException:  # as study.optimize does: a trial interrupted, or asked and left by an error, FAILED
            teller.fail_running()
            raise
    return run.summary()


def _check_arguments(study: Any, n_trials: Any, group_size: Any, training: Any) -> None:
    """One line naming what `optimize` cannot take, before any trial is asked."""
    if optuna is None:
        raise MissingDependency("wide_tessera.integrations.optuna needs optuna: pip install optuna")
    if not isinstance(study, optuna.Study):
        raise WideTesseraError(f"study={study!r}: give an optuna.Study (optuna.create_study(...))")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise WideTesseraError(f"n_trials={n_trials!r}: give a positive int")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise WideTesseraError(f"group_size={group_size!r}: give a positive int, or None to size groups by measurement")
    if not isinstance(training, Training):
        raise WideTesseraError(f"training={training!r}: give a wide_tessera.integrations.optuna.Training")
    if len(study.directions) != 1:
        raise WideTesseraError(
            f"the study has {len(study.directions)} objectives: optimize trains each trial to one loss; give a "
            "single-objective study"
        )


class _Scheduler:
    """One `optimize` call's state: the trials asked and waiting for their group to fill, per shape
    (`pending`), each shape's group size (`sizes`), the groups trained, and the seconds spent sizing."""

    def __init__(
        self,
        teller: Teller,
        suggest: Callable[[Any], Dict[str, Any]],
        build: Callable[[Dict[str, Any]], nn.Module],
        training: Training,
        n_trials: int,
        table_path: Path,
        device: str,
        timeout: Optional[float],
        progress: bool,
    ) -> None:
        self.teller, self.suggest, self.build, self.training = teller, suggest, build, training
        self.n_trials, self.table_path, self.device, self.timeout, self.progress = (
            n_trials, table_path, device, timeout, progress
        )  # fmt: skip
        self.start = time.perf_counter()
        self.pending: Dict[str, List[Member]] = {}
        self.sizes: Dict[str, Sizing] = {}  # per shape
        self.shapes: Dict[str, List[Dict[str, Any]]] = {}
        self.groups: List[GroupRecord] = []
        self.estimate: Optional[float] = None
        self.each_s: Optional[float] = None  # one model's step alone
        self.asked, self.sizing, self.pruned_by_suggest = 0, 0.0, 0

    def asking(self) -> bool:
        """Whether another trial is asked: trials are left, time is left, and nothing raised."""
        return self.asked < self.n_trials and _asking(self.start, self.timeout, self.teller)

    def ask(self, group_size: Optional[int], strategy: Optional[str], share: float) -> None:
        """Ask one trial, build its model and put it with its shape's waiting trials; the first
        trial of a shape sizes its groups. A trial whose own code raises fails alone."""
        trial = self.teller.ask()
        self.asked += 1
        try:
            params = suggested(self.suggest, trial)
            seed = trial_seed(trial, params)
            model = build_model(self.build, trial, params, self.device).to(self.device)
            member = Member(trial, params, model, Draws(seed, self.device))
            key = _shape_key(member.model, member.draws.batch(self.training, params, 0, keep=False)[0])
        except optuna.TrialPruned:  # as study.optimize does: this trial is over, the study goes on
            self.teller.tell(trial, state=optuna.trial.TrialState.PRUNED)
            self.pruned_by_suggest += 1
            return
        except Exception as error:  # noqa: BLE001  the trial's own code raised: it fails alone
            self.teller.failed(trial, error)
            return
        if self.each_s is None:
            self.each_s = step_seconds(member, self.training, self.device)
            self.estimate = self.each_s * self.training.steps * self.n_trials
        if key not in self.sizes:
            began = time.perf_counter()
            self.sizes[key] = size_groups(
                member, self.training, group_size, strategy, self.table_path, self.n_trials, self.device, share,
                self.each_s,
            )  # fmt: skip
            self.sizing += time.perf_counter() - began
        self.pending.setdefault(key, []).append(member)
        self.shapes.setdefault(key, []).append(params)

    def pruner_waits(self) -> bool:
        """Whether the study's pruner judges no trial yet (_finished_first): a group of 16 trained
        before any trial finished pruned none of them, where the sequential study, its first
        trials done, pruned most at their first report (study_quality's conv net, SuccessiveHalving:
        0.50x to 0.70x of the sequential study's time, against 0.67x to 0.96x with its first trial
        alone, three seeds in one run)."""
        study = self.teller.study
        finished = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return len(finished) < _finished_first(study.pruner)

    def size(self, key: str) -> int:
        """How many waiting trials of shape `key` make its next group: one while the pruner waits
        for finished trials (as the sequential study's first trials train alone), unless the size
        is the caller's."""
        sizing = self.sizes[key]
        return 1 if not sizing.given and self.pruner_waits() else sizing.size

    def train(self, key: str) -> None:
        """Train the next group of shape `key`: its size's first waiting trials (all that wait once
        no more are asked); a group that probed leaves its decision to the shape's later groups."""
        size = self.size(key)
        members, rest = self.pending[key][:size], self.pending[key][size:]
        if rest:
            self.pending[key] = rest
        else:
            del self.pending[key]
        probe = self.sizes[key].probe if len(members) > 1 else None  # a trial alone times nothing to size by
        plan = Plan(self.training, self.table_path, self.sizes[key].strategy, self.device, probe)
        clock = (self.start, self.estimate or 0.0) if self.progress else None
        with seeded(members[0].draws.training_seed, self.device):  # the group's dropout masks
            self.groups.append(train_group(self.teller, members, plan, clock, len(self.groups), key))
        if size < self.sizes[key].size:
            needs = _finished_first(self.teller.study.pruner)
            self.groups[-1].why = (
                f"alone: the {type(self.teller.study.pruner).__name__} judges a trial once {needs} have finished"
            )
        if plan.probe is not None:  # the later groups of the shape run what it decided
            self.sizes[key] = probed(self.sizes[key], members[0], self.table_path)
            self.sizing += plan.probe.cost_s

    def summary(self) -> StudySummary:
        """What the study did, its shapes labelled by the parameters that tell them apart."""
        told_apart = shape_params(self.shapes)
        named = labels(self.shapes, told_apart)
        for g in self.groups:
            g.shape = named[g.shape]
        return StudySummary(
            {named[key]: s.why for key, s in self.sizes.items()},
            self.groups,
            time.perf_counter() - self.start,
            self.estimate or 0.0,
            told_apart,
            self.sizing,
            self.pruned_by_suggest,
        )


def _finished_first(pruner: Any) -> int:
    """How many finished trials Optuna's `pruner` waits for before it stops any: SuccessiveHalving's
    'auto' resource and Hyperband's 'auto' budget are read from the first finished trial, the
    median's and percentile's comparisons begin after their startup trials; 0 for others (a
    threshold judges the first report). Read from their own settings."""
    if isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner):
        return 1 if pruner._min_resource is None else 0
    if isinstance(pruner, optuna.pruners.HyperbandPruner):
        return 1 if pruner._max_resource == "auto" else 0
    if isinstance(pruner, optuna.pruners.PercentilePruner):  # MedianPruner is one
        return int(pruner._n_startup_trials)
    return 0


def _asking(start: float, timeout: Optional[float], teller: Teller) -> bool:
    """Whether another trial is asked: not after `timeout` seconds, nor once a trial raised an error
    `catch` does not name (the trials asked are trained and told first)."""
    return (timeout is None or time.perf_counter() - start < timeout) and teller.raised is None


def _shape_key(model: nn.Module, x: Any) -> str:
    """What N models must share to train as one: their class, what every fused strategy needs
    alike (ops.alike.layout_of: each tensor's shape, dtype and device, each plain setting but a
    rate, which fuse() runs per model: widen.rates), and their inputs' shapes and dtypes, which
    pack stacks: a batch size suggested per trial changes no model, and its trials, grouped
    together, failed the whole study at their first step."""
    leaves, _ = trees.flat(x)
    inputs = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in leaves]
    rates = set(rate_settings(model))
    layout = sorted((k, v) for k, v in layout_of(model).items() if k not in rates)
    return repr((type(model).__qualname__, layout, inputs))
