"""A group of trials trained as one fused model: reporting each trial, pruning, repacking the
survivors, telling Optuna."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from tqdm.auto import tqdm

from ...core.roles import BASELINE
from ...dispatch.build import Fused
from ...dispatch.fuse import fuse
from .host import optuna
from .probe import Probe, now
from .sequential import Resume, train_alone
from .summary import GroupRecord
from .tell import Teller
from .training import Training, forward_backward, on_device
from .trial import Member


@dataclass(frozen=True)
class Plan:
    """How a group trains: the training, the table fuse() decides from, the strategy forced (None:
    the table's), the device, and the probe it runs first (None: none; see probe.Probe)."""

    training: Training
    table: Path
    strategy: Optional[str]
    device: str
    probe: Optional[Probe] = None


class _Group:
    """The trials of one group as they train: the fused model, its optimizer and schedule."""

    def __init__(self, members: List[Member], plan: Plan):
        self.members, self.plan = members, plan
        models = [m.model for m in members]
        strategy = "loop" if len(models) == 1 else plan.strategy  # one trial: nothing to fuse, nothing to ask
        self.fused: Fused = fuse(models, table=plan.table, mode="train", randomness="different", strategy=strategy)
        self.after_backward = plan.training.wide_step(self.fused, [m.params for m in members])
        # wide_tessera.optim's: freeze, state_dicts and load_state_dicts beside torch's interface
        self.opt: Any = self.after_backward.optimizers[0]

    def step(self, step: int, failed: Dict[int, Exception]) -> Dict[int, float]:
        """One training step: each member's loss, by its index; a member whose batch or loss raised
        is put in `failed` instead (a member whose batch raised runs on a group mate's input, its
        output unused), and the group is repacked without it after the step."""
        training, batches = self.plan.training, {}
        for i, m in enumerate(self.members):
            try:
                batches[i] = on_device(self.plan.device, m.draws.batch(training, m.params, step))
            except Exception as error:  # noqa: BLE001  the trial's own code (batch, loss): it fails alone
                failed[i] = error
        fused = self.fused
        losses = forward_backward(training, lambda xs: fused.unpack(fused(fused.pack(xs))), batches,
                                  len(self.members), failed)  # fmt: skip
        if losses:
            self.after_backward()
        return losses

    def schedule_states(self) -> List[Optional[Dict[str, Any]]]:
        """Each member's scheduler state (None where the training has no schedule)."""
        schedules = self.after_backward.schedules
        return schedules[0].state_dicts() if schedules else [None] * len(self.members)

    def without(self, kept: List[int], step: int, strategy: Optional[str] = None) -> "_Group":
        """The group repacked with only the members at `kept`, after step `step`: their weights and
        optimizer states as they are, their schedule where it is; `strategy`: run this one from now
        on (a probe's turn, or its winner). The weights go back into the members' own modules
        (fuse() copied them): copies of 16 small conv nets made most of a probe's switch."""
        models = self.fused.unfuse(into=[m.model for m in self.members])
        states, schedules = self.opt.state_dicts(), self.schedule_states()
        members = [replace(self.members[i], model=models[i]) for i in kept]
        regroup = _Group(members, self.plan if strategy is None else replace(self.plan, strategy=strategy))
        regroup.opt.load_state_dicts([states[i] for i in kept])  # each model's lr as scheduled, its initial lr
        if regroup.after_backward.schedules:  # each where it was: step + 1 steps taken
            regroup.after_backward.schedules[0].load_state_dicts([schedules[i] for i in kept])
        return regroup


def train_group(
    teller: Teller, members: List[Member], plan: Plan, clock: Optional[Tuple[float, float]], index: int, key: str
) -> GroupRecord:
    """Train one group to the end (reporting each trial's mean loss, pruning, failing a trial that
    raised and repacking on the way), and tell Optuna each surviving trial's value. `clock`: when
    the study began and the sequential study's estimated time, for the progress bar (None: no bar)."""
    refused = [m.trial.number for m in members if _refuses_settings(teller, m, plan)]  # before a group is built
    members = [m for m in members if m.trial.number not in refused]
    if not members:
        return GroupRecord(refused, key, None, "every trial's settings refused", 0.0, failed=refused)
    train = _train_one if len(members) == 1 else _train_fused
    record = train(teller, members, plan, clock, index, key)
    record.trials, record.failed = [*refused, *record.trials], [*refused, *record.failed]
    return record


def _train_fused(
    teller: Teller, members: List[Member], plan: Plan, clock: Optional[Tuple[float, float]], index: int, key: str
) -> GroupRecord:
    """A group of several trials trained as one fused model (see train_group)."""
    start, training, probe = time.perf_counter(), plan.training, plan.probe
    alone, began = False, now()
    group = _Group(members, plan)
    if probe is not None:  # the loop's build: what a switch back to it is predicted by
        probe.switch_s.setdefault(BASELINE, now() - began)
        probe.began(len(members))
    record = GroupRecord(
        [m.trial.number for m in members], key, group.fused.strategy, group.fused.decision.match.reason, 0.0
    )
    _label_trials(members, group.fused.strategy)
    history: Dict[int, List[float]] = {m.trial.number: [] for m in members}
    values: Dict[int, float] = {}
    what = f"group {index}: {len(members)} trials, {group.fused.strategy or 'loop'}"
    bar = tqdm(total=training.steps, desc=what, disable=clock is None, leave=False)
    for step in range(training.steps):
        failed: Dict[int, Exception] = {}
        if probe is not None and not probe.done:
            group, losses, alone = _probe_step(group, probe, step, failed, record)
        else:
            losses = group.step(step, failed)
        for i, error in failed.items():
            teller.failed(group.members[i].trial, error)
            record.failed.append(group.members[i].trial.number)
        for i, loss in losses.items():
            history[group.members[i].trial.number].append(loss)
        bar.update(1)
        kept = list(losses)
        if training.reports_at(step):
            kept = [i for i in kept if not _pruned(teller, group, i, history, values, step, record)]
        if not kept:
            break
        if len(kept) < len(group.members):  # a pruned or failed trial stops costing time
            group = group.without(kept, step)
            record.repacked.append(len(kept))
            if probe is not None and not probe.done:
                probe.resized(len(kept))
        if clock is not None:
            elapsed = f"{time.perf_counter() - clock[0]:.0f}s of ~{clock[1]:.0f}s sequential"
            bar.set_postfix(training=len(group.members), pruned=len(record.pruned), study=elapsed)
        if alone:  # no fused strategy won: the trials go on one at a time, as the sequential loop trains them
            bar.close()
            record.why += "; the trials then trained one at a time"
            _one_at_a_time(teller, group, step + 1, history, record)
            record.seconds = time.perf_counter() - start
            return record
    bar.close()
    if probe is not None and not probe.done:  # its training ended first: what it measured, said
        record.why = probe.said()
    if kept:
        _tell_finished(teller, group, values, record)
    record.seconds = time.perf_counter() - start
    return record


def _probe_step(
    group: _Group, probe: Probe, step: int, failed: Dict[int, Exception], record: GroupRecord
) -> Tuple[_Group, Dict[int, float], bool]:
    """One step on the probe's side of its turn, timed with its switch. Where that step ends the
    probe, the group turns to the winner (its build is what a group the table sized builds too,
    not sizing). Returns the group, the step's losses, and whether no fused strategy won."""
    group, switch_s = _turn(group, probe.begin_step(), step)
    began = now()
    losses = group.step(step, failed)
    probe.timed(now() - began, switch_s)
    if not probe.done:
        return group, losses, False
    group, _ = _turn(group, probe.winner() or BASELINE, step + 1)
    record.strategy, record.why = group.fused.strategy, probe.said()
    _label_trials(group.members, group.fused.strategy)
    return group, losses, probe.winner() is None


def _tell_finished(teller: Teller, group: _Group, values: Dict[int, float], record: GroupRecord) -> None:
    """Tell each member that trained to the end its value: the training's evaluate of its model
    where it has one, else its last reported loss; a member whose evaluate raises fails alone."""
    evaluate = group.plan.training.evaluate
    models = group.fused.unfuse() if evaluate is not None else []
    for i, m in enumerate(group.members):
        try:
            value = evaluate(models[i], m.params) if evaluate is not None else values[m.trial.number]
        except Exception as error:  # noqa: BLE001  the trial's own evaluate: it fails alone
            teller.failed(m.trial, error)
            record.failed.append(m.trial.number)
        else:
            teller.tell(m.trial, value)


def _one_at_a_time(
    teller: Teller, group: _Group, start: int, history: Dict[int, List[float]], record: GroupRecord
) -> None:
    """Each member of the group trained alone from step `start` to the end, as the sequential loop
    trains it (train_alone: torch's optimizer, its state and schedule carried over from the
    group's), then told: where the group would have run as a loop, each trial pays no wrapper and
    can be pruned against the ones finished before it."""
    models, states, schedules = group.fused.unfuse(), group.opt.state_dicts(), group.schedule_states()
    for i, m in enumerate(group.members):
        try:
            resume = Resume(start, states[i], schedules[i], history[m.trial.number])
            value = train_alone(m.trial, m.params, models[i], m.draws, group.plan.training, group.plan.device,
                                resume=resume)  # fmt: skip
        except optuna.TrialPruned:
            teller.tell(m.trial, state=optuna.trial.TrialState.PRUNED)
            record.pruned.append(m.trial.number)
        except Exception as error:  # noqa: BLE001  the trial's own code raised: it fails alone
            teller.failed(m.trial, error)
            record.failed.append(m.trial.number)
        else:
            teller.tell(m.trial, value)


def _turn(group: _Group, side: str, step: int) -> Tuple[_Group, Optional[float]]:
    """The group running `side` (the loop: BASELINE) from `step` on, repacked where it ran another,
    and the switch's seconds (None: no switch)."""
    strategy = "loop" if side == BASELINE else side
    if (group.fused.strategy or "loop") == strategy:
        return group, None
    began = now()
    group = group.without(list(range(len(group.members))), step - 1, strategy)
    return group, now() - began


def _refuses_settings(teller: Teller, member: Member, plan: Plan) -> bool:
    """Whether torch's optimizer refuses the trial's settings (a negative learning rate): the trial
    then fails alone, as it does sequentially, where in the group's one optimizer it failed all."""
    try:
        plan.training.alone_step(member.model, member.params)
    except Exception as error:  # noqa: BLE001  torch's own check of the trial's settings
        teller.failed(member.trial, error)
        return True
    return False


def _pruned(
    teller: Teller, group: _Group, i: int, history: Dict[int, List[float]], values: Dict[int, float], step: int,
    record: GroupRecord,
) -> bool:  # fmt: skip
    """Report member i's mean loss at `step`; where the pruner stops it (at the last report too, as
    an objective asks its pruner), freeze it and tell it PRUNED."""
    m = group.members[i]
    values[m.trial.number] = group.plan.training.reported(history[m.trial.number])
    m.trial.report(values[m.trial.number], step)
    if not m.trial.should_prune():
        return False
    group.opt.freeze(i)
    teller.tell(m.trial, state=optuna.trial.TrialState.PRUNED)
    record.pruned.append(m.trial.number)
    return True


def _label_trials(members: List[Member], strategy: Optional[str]) -> None:
    for m in members:
        m.trial.set_user_attr("wide_tessera_group", members[0].trial.number)  # unique in the study, whatever call
        m.trial.set_user_attr("wide_tessera_strategy", strategy or "loop")


def _train_one(
    teller: Teller, members: List[Member], plan: Plan, clock: Optional[Tuple[float, float]], index: int, key: str
) -> GroupRecord:
    """A group of one trial trains as the sequential loop trains it (`train_alone`): nothing to
    fuse, and no wrapper to pay for (through fuse()'s loop and wide_tessera.optim it cost 5% of a
    trial of hidden 256, one trial at a time)."""
    (member,) = members
    start, number = time.perf_counter(), member.trial.number
    record = GroupRecord([number], key, None, "one trial: nothing to fuse", 0.0)
    _label_trials([member], None)
    bar = tqdm(
        total=plan.training.steps, desc=f"group {index}: trial {number} alone", disable=clock is None, leave=False
    )
    try:
        value = train_alone(member.trial, member.params, member.model, member.draws, plan.training, plan.device,
                             lambda: bar.update(1))  # fmt: skip
    except optuna.TrialPruned:
        teller.tell(member.trial, state=optuna.trial.TrialState.PRUNED)
        record.pruned.append(number)
    except Exception as error:  # noqa: BLE001  the trial's own code raised: it fails alone
        teller.failed(member.trial, error)
        record.failed.append(number)
    else:
        teller.tell(member.trial, value)
    bar.close()
    record.seconds = time.perf_counter() - start
    return record
