"""A group of trials trained as one fused model: reporting each trial, pruning, repacking the
survivors, telling Optuna."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from tqdm.auto import tqdm

from ...dispatch.build import Fused
from ...dispatch.fuse import fuse
from .host import optuna
from .sequential import train_alone
from .summary import GroupRecord
from .training import Training, loss_of, on_device
from .trial import Member


@dataclass(frozen=True)
class Plan:
    """How every group of a study trains: the training, the table fuse() decides from, the strategy
    forced (None: the table's), the device."""

    training: Training
    table: Path
    strategy: Optional[str]
    device: str


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

    def step(self, step: int) -> List[float]:
        training = self.plan.training
        batches = [on_device(self.plan.device, m.draws.batch(training, m.params, step)) for m in self.members]
        outs = self.fused.unpack(self.fused(self.fused.pack([x for x, _ in batches])))
        losses = [loss_of(training, o, y) for o, (_, y) in zip(outs, batches)]
        torch.autograd.backward(losses)
        self.after_backward()
        return [float(loss.detach()) for loss in losses]

    def without(self, kept: List[int], step: int) -> "_Group":
        """The group repacked with only the members at `kept`, after step `step`: their weights and
        optimizer states as they are, their schedule where it is."""
        models = self.fused.unfuse()
        states = self.opt.state_dicts()
        members = [replace(self.members[i], model=models[i]) for i in kept]
        regroup = _Group(members, self.plan)
        regroup.opt.load_state_dicts([states[i] for i in kept])  # each model's lr as scheduled, its initial lr
        regroup.after_backward.restart_schedules(step)  # at its position: step + 1 steps taken
        return regroup


def train_group(
    study: Any, members: List[Member], plan: Plan, clock: Optional[Tuple[float, float]], index: int, key: str
) -> GroupRecord:
    """Train one group to the end (reporting each trial's mean loss, pruning and repacking on the
    way), and tell Optuna each surviving trial's value. `clock`: when the study began and the
    sequential study's estimated time, for the progress bar (None: no bar)."""
    start, training = time.perf_counter(), plan.training
    if len(members) == 1:
        return _train_one(study, members[0], plan, clock, index, key)
    group = _Group(members, plan)
    record = GroupRecord(
        [m.trial.number for m in members], key, group.fused.strategy, group.fused.decision.match.reason, 0.0
    )
    _label_trials(members, group.fused.strategy)
    history: Dict[int, List[float]] = {m.trial.number: [] for m in members}
    values: Dict[int, float] = {}
    what = f"group {index}: {len(members)} trials, {group.fused.strategy or 'loop'}"
    bar = tqdm(total=training.steps, desc=what, disable=clock is None, leave=False)
    for step in range(training.steps):
        for m, loss in zip(group.members, group.step(step)):
            history[m.trial.number].append(loss)
        bar.update(1)
        if not training.reports_at(step):
            continue
        kept = []
        for i, m in enumerate(group.members):
            values[m.trial.number] = training.reported(history[m.trial.number])
            m.trial.report(values[m.trial.number], step)
            if m.trial.should_prune():  # at the last report too, as an objective asks its pruner
                group.opt.freeze(i)
                study.tell(m.trial, state=optuna.trial.TrialState.PRUNED)
                record.pruned.append(m.trial.number)
            else:
                kept.append(i)
        if not kept:
            break
        if len(kept) < len(group.members):  # a pruned trial stops costing time
            group = group.without(kept, step)
            record.repacked.append(len(kept))
        if clock is not None:
            elapsed = f"{time.perf_counter() - clock[0]:.0f}s of ~{clock[1]:.0f}s sequential"
            bar.set_postfix(training=len(group.members), pruned=len(record.pruned), study=elapsed)
    bar.close()
    if len(record.pruned) < len(members):
        models = group.fused.unfuse() if training.evaluate is not None else []
        for i, m in enumerate(group.members):
            value = training.evaluate(models[i], m.params) if training.evaluate is not None else values[m.trial.number]
            study.tell(m.trial, value)
    record.seconds = time.perf_counter() - start
    return record


def _label_trials(members: List[Member], strategy: Optional[str]) -> None:
    for m in members:
        m.trial.set_user_attr("wide_tessera_group", members[0].trial.number)  # unique in the study, whatever call
        m.trial.set_user_attr("wide_tessera_strategy", strategy or "loop")


def _train_one(
    study: Any, member: Member, plan: Plan, clock: Optional[Tuple[float, float]], index: int, key: str
) -> GroupRecord:
    """A group of one trial trains as the sequential loop trains it (`train_alone`): nothing to
    fuse, and no wrapper to pay for (through fuse()'s loop and wide_tessera.optim it cost 5% of a
    trial of hidden 256, one trial at a time)."""
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
        study.tell(member.trial, state=optuna.trial.TrialState.PRUNED)
        record.pruned.append(number)
    else:
        study.tell(member.trial, value)
    bar.close()
    record.seconds = time.perf_counter() - start
    return record
