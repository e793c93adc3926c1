"""Sizing on the study's own work: the first group's real training steps run as the loop and
fused, in turns, timed, until the benchmark's decision rule (results.decisions.decide) settles
or the study's sizing share is spent; the group goes on with the winner.

Measuring a shape the table lacked by benchmark_custom at N = 2, 4, 8, ... cost 114 s of a
137 s study whose sequential run took 5.5 to 19.4 s, and on a busy machine decided nothing.
Here every step timed is a step of training (both sides compute the same step of the same
trials, so nothing is thrown away but the switches between them), and what probing costs is at
most `share` of the study's time so far and of what its group would still run as the loop (at
most of the study's estimated sequential time): a share of the estimate alone, which counts
every trial's every step, let a pruned study (3 s sequential, estimated 9 s unpruned) spend
18-32% of its fused time sizing, and a share of the time so far alone made a study where fusing
wins wait on the loop for its first switch (an MLP study 1.08x faster than the loop where the
share of the estimate gave 1.64x). What it learns is
written to the dispatch table: a win as 'unconfirmed', which a second study's agreeing probe
confirms ('fuse', which fuse() then acts on), the way the benchmark confirms a win by a second
pass; a loss as 'loop'; nothing settled as 'open', so that the next study probes again."""

from __future__ import annotations

import datetime
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...core.roles import BASELINE
from ...dispatch.fuse import decide_at
from ...dispatch.table import DispatchEntry, NVerdict, merge_entries
from ...results.decisions import ALPHA, Call, decide
from .trial import Member

# steps each side runs per turn: the first after a switch is not timed (a repacked group's first
# step pays its lazy set-up), the others are; a switch repacks the group (surgery traces it), so
# turns of a few steps keep the switches' cost below the steps'
TURN_STEPS = 4
# the rounds (one turn of every side) at which the rule looks, and the level of each look: at three
# rounds the interval is the ratios' range, so a decision needs all three to agree
LOOKS = (3, 5, 10, 20, 40)
LEVEL = 1 - ALPHA / len(LOOKS)
# the fused strategies a probe times against the loop
STRATEGIES = ("vmap", "surgery")


@dataclass
class Probe:
    """The first group's turns: which side trains each step, the ms of each side's timed steps
    by round, and what the rule decided.

    It costs at most `budget_s`: `share` of the study's time so far and of its group's steps left
    as the loop would take them (`each_s` a model's step; at most of `estimate_s`), which shrink
    as its trials are pruned. Before each unit (a step, or a switch to another side with its
    first step) it predicts the unit's cost by the last one of its kind measured. A turn over,
    it switches to the next side where the switch fits; else it waits, its side training on,
    while that side costs nothing beyond the loop's steps (the loop's own, or a faster one's);
    else it stops. A unit begun is not cut (a switch's build and capture run to their end), so a
    side whose switch nothing has measured yet is tried only first, while nothing is spent: the
    sides are the loop, at most one strategy of unknown cost, then those this process measured
    (STRATEGIES' others wait for a later study of the class: `untried`).
    Counting a turn's cost only after it began, the 3.3 s share of a conv study was overrun by a
    vmap turn and a surgery switch to 6.4 s."""

    share: float
    each_s: float  # one model's training step, alone (sizing.step_seconds)
    steps_total: int  # the group's training steps
    estimate_s: float  # the study's estimated sequential time
    start: float  # when the study began, on the probe's clock (now)
    strategies: Sequence[str] = STRATEGIES
    untried: Sequence[str] = ()
    given: bool = False  # the group size is the user's: the group goes on fused whatever the rule said
    samples: Dict[str, List[float]] = field(default_factory=dict)
    spent_s: float = 0.0
    switching_s: float = 0.0
    excess_s: float = 0.0  # what the fused turns' steps took beyond the loop's (the sequential's) time
    # each side's last switch, with its first step: the table's (an earlier study's) until one is timed here
    switch_s: Dict[str, float] = field(default_factory=dict)
    step_s: Dict[str, float] = field(default_factory=dict)  # each side's last timed step beyond the loop's
    call: Optional[Call] = None
    steps: int = 0
    n: int = 0  # the group's size, which its samples were timed at
    began_n: int = 0  # its size when the probe began
    turn: int = 0  # the sides take turns: sides[turn % len(sides)] trains now
    turn_steps: int = 0  # the steps of this turn so far (after TURN_STEPS, it waits for its switch)
    _block: List[float] = field(default_factory=list)
    _setting_up: bool = False  # the turn's steps since a repack pay its set-up: not sampled

    @staticmethod
    def planned(
        share: float, each_s: float, steps: int, estimate_s: float, switches: Dict[str, float], given: bool = False
    ) -> "Probe":
        """A probe of `share` of the study's time (beginning now) and of its group's steps left (see
        the class's docstring): the strategies whose switch cost an earlier study measured
        (`switches`, the dispatch table's) within what the share can reach, after the first one
        none did; the others untried (a side whose switch never fits holds every round open).
        A capture's cost recurs at every build (surgery's torch.export capture: 0.5 to 2.3 s on the
        loaded 2-core machine, where a vmap switch took 20 ms)."""
        unknown = [s for s in STRATEGIES if s not in switches]
        reached = [s for s in STRATEGIES if s in switches and switches[s] <= share * estimate_s]
        untried = [s for s in STRATEGIES if s not in (*unknown[:1], *reached)]
        known = {s: switches[s] for s in STRATEGIES if s in switches}
        return Probe(share, each_s, steps, estimate_s, now(), (*unknown[:1], *reached), untried, given, switch_s=known)

    @property
    def sides(self) -> List[str]:
        return [BASELINE, *self.strategies]

    @property
    def side(self) -> str:
        """The side that trains now."""
        return self.sides[self.turn % len(self.sides)]

    @property
    def budget_s(self) -> float:
        """What probing may have cost by now (see the class's docstring)."""
        return self.share * min(self.estimate_s, self._elapsed_s + self._ahead_s)

    @property
    def _elapsed_s(self) -> float:
        return max(0.0, now() - self.start)

    @property
    def _ahead_s(self) -> float:
        """The group's steps left, as the loop would take them."""
        return self.each_s * self.n * max(0, self.steps_total - self.steps)

    def begin_step(self) -> str:
        """The side the next step trains on: the next one once this turn's steps are done and the
        switch to it fits, else this one (see the class's docstring)."""
        if self.turn_steps >= TURN_STEPS and self._switch_fits():
            self.turn, self.turn_steps = self.turn + 1, 0
        return self.side

    def timed(self, seconds: float, switch_s: Optional[float] = None) -> None:
        """The step's time on its side (`switch_s`: the switch to the side just before it); after
        each round, a look where one is due."""
        self.spent_s += seconds + (switch_s or 0.0)
        self.steps += 1
        side, loop = self.side, self.samples.get(BASELINE)
        excess = max(0.0, seconds - statistics.median_high(loop) / 1e3) if side != BASELINE and loop else 0.0
        self.excess_s += excess
        if switch_s is not None:
            self.switching_s += switch_s
            self.switch_s[side] = switch_s + excess
            # the side's next step, before one of its plain steps is timed, is predicted by this
            # first one (which pays its lazy set-up, so errs long): predicted as nothing, a surgery
            # turn overran a conv study's share by 0.08 s
            self.step_s.setdefault(side, excess)
        else:
            self.step_s[side] = excess
        # a turn's first step pays the switch's lazy set-up, and the steps while it waits are not its
        if 0 < self.turn_steps < TURN_STEPS and not self._setting_up:
            self._block.append(seconds * 1e3)
        self.turn_steps += 1
        if self.turn_steps == TURN_STEPS:
            if self._block:
                self.samples.setdefault(side, []).append(sum(self._block) / len(self._block))
            self._block, self._setting_up = [], False
            rounds = min((len(self.samples.get(s, [])) for s in self.sides), default=0)
            if side == self.sides[-1] and rounds in LOOKS:
                call = decide(self.samples, self.strategies, LEVEL)
                self.call = call if call.settled else None

    def resized(self, n: int) -> None:
        """The group repacked to `n` trials (some pruned or failed): its rounds begin again, at n. A
        step of N trials is not a step of n: a loop turn timed at 16 against a fused one at 4 made
        the fused side look 4x faster than it is."""
        self.n, self.samples, self._block, self._setting_up, self.call = n, {}, [], True, None

    def began(self, n: int) -> None:
        """The probe's group, of `n` trials, begins."""
        self.n = self.began_n = n

    @property
    def cost_s(self) -> float:
        """What probing added to the study: the switches, and the fused turns' time beyond the loop's
        (the steps themselves train: a step the loop takes is the sequential study's own cost)."""
        return self.switching_s + self.excess_s

    def _switch(self) -> Tuple[str, float]:
        """The next side, and the predicted cost of the switch to it: the last measured (here, or
        by an earlier study); where nothing measured one, nothing if nothing is spent yet, else
        more than any share."""
        side = self.sides[(self.turn + 1) % len(self.sides)]
        measured = self.switch_s.get(side)
        if measured is None:
            measured = 0.0 if self.cost_s == 0.0 else math.inf
        return side, measured

    def _switch_fits(self) -> bool:
        return self.cost_s + self._switch()[1] <= self.budget_s

    @property
    def _waiting(self) -> bool:
        """Whether the turn is over and its switch does not fit yet."""
        return self.turn_steps >= TURN_STEPS and not self._switch_fits()

    def next_unit(self) -> Tuple[str, float]:
        """The unit the next step begins (a switch to a side, or a step of one) and its predicted
        cost (the last of its kind measured, see _switch)."""
        if self.turn_steps >= TURN_STEPS:
            side, cost = self._switch()
            return f"a switch to {_named(side)}", cost
        return f"a step of {_named(self.side)}", self.step_s.get(self.side, 0.0)

    @property
    def done(self) -> bool:
        """Settled; down to one trial (nothing left to fuse); or the next unit does not fit and
        cannot be waited for: a switch nothing measured, or a side that costs more than the loop's
        steps (waiting on one that does not costs the study nothing)."""
        if self.call is not None or self.n < 2:
            return True
        if not self._waiting:
            return self.cost_s + self.next_unit()[1] > self.budget_s
        return self.step_s.get(self.side, 0.0) > 0.0 or math.isinf(self._switch()[1])

    def winner(self) -> Optional[str]:
        """The strategy the group goes on with (None: the loop): the rule's, or where it did not
        settle within the budget, the loop (fusing unknown to pay is not taken). A size given goes
        on fused whatever the rule said, with the fastest strategy timed (as a size given runs the
        strategy the table names at it whatever its verdict): the loop ran `group_size=8` alone."""
        call = self.final()
        if self.fuses:
            return call.strategy
        if not self.given:
            return None
        timed = {s: statistics.median_high(v) for s, v in self.samples.items() if s in self.strategies and v}
        return call.strategy or min(timed, key=timed.__getitem__, default=self.strategies[0])

    @property
    def fuses(self) -> bool:
        """Whether the rule found a fused strategy faster."""
        return self.final().kind in ("fuse", "marginal")

    def final(self) -> Call:
        if self.call is not None:
            return self.call
        rounds = min((len(self.samples.get(s, [])) for s in self.sides), default=0)
        return Call("open") if rounds < LOOKS[0] else _open(decide(self.samples, self.strategies, LEVEL))

    def said(self) -> str:
        """What was measured, for how long, what it cost against the share, and why it stopped, in
        one line."""
        call = self.final()
        rounds = min((len(self.samples.get(s, [])) for s in self.sides), default=0)
        verdict = f"{call.kind}{' ' + call.strategy if call.strategy else ''}"
        untried = (
            f" ({', '.join(self.untried)} untried: no switch to it measured yet, or one the share cannot reach)"
            if self.untried else ""
        )  # fmt: skip
        unit, cost = self.next_unit()
        forced = "" if self.fuses or not self.given else f"; fused as the size given asks, with {self.winner()}"
        stopped = "" if self.call is not None else "; stopped with one trial left: not settled" if self.n < 2 else (
            f"; the group's training ended first, waiting for {unit} (~{cost:.2f} s) to fit: not settled"
            if not self.done else f"; stopped before {unit} (~{'?' if math.isinf(cost) else f'{cost:.2f}'} s, "
            f"{max(0.0, self.budget_s - self.cost_s):.2f} s of the share left): not settled"
        )  # fmt: skip
        elapsed, ahead = self._elapsed_s, self._ahead_s
        share = (
            f"{self.share:.0%} of the study's {elapsed:.1f} s so far and its group's {ahead:.1f} s left as the loop"
            if elapsed + ahead < self.estimate_s
            else f"{self.share:.0%} of its estimated sequential {self.estimate_s:.1f} s"
        )  # fmt: skip
        return (
            f"sized on the first group's own steps at N={self.n}{self._repacked}: loop, "
            f"{', '.join(self.strategies)} in turns{untried}, "
            f"{rounds} round(s), {self.steps} training steps in {self.spent_s:.2f} s, costing {self.cost_s:.2f} s "
            f"({self.switching_s:.2f} s switching) of a {self.budget_s:.2f} s share ({share}): "
            f"{verdict}{stopped}{forced}"
        )

    @property
    def _repacked(self) -> str:
        return f" (of {self.began_n}, the others pruned)" if self.n != self.began_n else ""

    def write(self, member: Member, table: Path) -> None:
        """What the probe learned, as a dispatch table entry at the N it timed (see the module's
        docstring)."""
        n = self.n
        match, case = decide_at(member.model, n, table, mode="train")
        call = self.final()
        before = [v for e in match.entries for v in e.verdicts if v.n == n]
        agreed = bool(before) and before[0].verdict in ("unconfirmed", "fuse") and before[0].strategy == call.strategy
        verdict = {"fuse": "fuse" if agreed else "unconfirmed", "marginal": "marginal", "loop": "loop"}.get(
            call.kind, "open"
        )
        entry = DispatchEntry(
            op=case.op, device=case.device, device_name=case.device_name, dtype=case.dtype, mode=case.mode,
            compile=case.compile, cuda_graph=case.cuda_graph, params=case.params,
            verdicts=[NVerdict(n, verdict, call.strategy)], crossover_n=n if verdict == "fuse" else None,
            measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            versions={"torch": torch.__version__}, threads=torch.get_num_threads(), preset="optuna-probe",
            switch_s={s: seconds for s, seconds in self.switch_s.items() if s in STRATEGIES},
        )  # fmt: skip
        table.parent.mkdir(parents=True, exist_ok=True)
        merge_entries(table, [entry])


def _named(side: str) -> str:
    return "the loop" if side == BASELINE else side


def _open(call: Call) -> Call:
    """A call reached before the rule's first look settled nothing: said as open."""
    return call if call.settled else Call("open", call.strategy)


def now() -> float:
    """The run's clock: the device's work finished, then the wall clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
