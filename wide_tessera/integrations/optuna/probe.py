"""Sizing on the study's own work: the first group's real training steps run as the loop and
fused, in turns, timed, until the benchmark's decision rule (results.decisions.decide) settles
or the study's sizing share is spent; the group goes on with the winner.

Measuring a shape the table lacked by benchmark_custom at N = 2, 4, 8, ... cost 114 s of a
137 s study whose sequential run took 5.5 to 19.4 s, and on a busy machine decided nothing.
Here every step timed is a step of training (both sides compute the same step of the same
trials, so nothing is thrown away but the switches between them), and a study never spends
more than `share` of its own estimated sequential time before it decides. What it learns is
written to the dispatch table: a win as 'unconfirmed', which a second study's agreeing probe
confirms ('fuse', which fuse() then acts on), the way the benchmark confirms a win by a second
pass; a loss as 'loop'; nothing settled as 'open', so that the next study probes again."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

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


@dataclass
class Probe:
    """The first group's turns: which side trains each step, the ms of each side's timed steps
    by round, and what the rule decided."""

    budget_s: float
    strategies: Sequence[str] = ("vmap", "surgery")
    samples: Dict[str, List[float]] = field(default_factory=dict)
    spent_s: float = 0.0
    switching_s: float = 0.0
    excess_s: float = 0.0  # what the fused turns' steps took beyond the loop's (the sequential's) time
    last_turn_s: float = 0.0  # the cost of the last switch and its turn: the next one is taken only if it fits
    call: Optional[Call] = None
    steps: int = 0
    _block: List[float] = field(default_factory=list)

    @property
    def sides(self) -> List[str]:
        return [BASELINE, *self.strategies]

    def side(self, step: int) -> str:
        """The side that trains `step` while the probe runs."""
        return self.sides[(step // TURN_STEPS) % len(self.sides)]

    def timed(self, step: int, seconds: float) -> None:
        """One step's time on its side; after each round, a look where one is due."""
        self.spent_s += seconds
        self.steps += 1
        loop = self.samples.get(BASELINE)
        if self.side(step) != BASELINE and loop:
            self.excess_s += max(0.0, seconds - sorted(loop)[len(loop) // 2] / 1e3)
        if step % TURN_STEPS:
            self._block.append(seconds * 1e3)
        if step % TURN_STEPS == TURN_STEPS - 1:
            self.samples.setdefault(self.side(step), []).append(sum(self._block) / len(self._block))
            self._block = []
        rounds = min((len(self.samples.get(s, [])) for s in self.sides), default=0)
        if step % (TURN_STEPS * len(self.sides)) == TURN_STEPS * len(self.sides) - 1 and rounds in LOOKS:
            call = decide(self.samples, self.strategies, LEVEL)
            self.call = call if call.settled else None

    @property
    def cost_s(self) -> float:
        """What probing added to the study: the switches, and the fused turns' time beyond the loop's
        (the steps themselves train: a step the loop takes is the sequential study's own cost)."""
        return self.switching_s + self.excess_s

    @property
    def done(self) -> bool:
        at_turn = self.steps % TURN_STEPS == 0
        return self.call is not None or self.cost_s + (self.last_turn_s if at_turn else 0.0) >= self.budget_s

    def winner(self) -> Optional[str]:
        """The strategy the group goes on with (None: the loop): the rule's, or where it did not
        settle within the budget, the loop (fusing unknown to pay is not taken)."""
        call = self.final()
        return call.strategy if call.kind in ("fuse", "marginal") else None

    def final(self) -> Call:
        if self.call is not None:
            return self.call
        rounds = min((len(self.samples.get(s, [])) for s in self.sides), default=0)
        return Call("open") if rounds < LOOKS[0] else _open(decide(self.samples, self.strategies, LEVEL))

    def said(self, n: int) -> str:
        """What was measured, for how long, and what it cost, in one line."""
        call = self.final()
        rounds = min((len(self.samples.get(s, [])) for s in self.sides), default=0)
        verdict = f"{call.kind}{' ' + call.strategy if call.strategy else ''}"
        return (
            f"sized on group 0's own steps at N={n}: loop, {', '.join(self.strategies)} in turns, {rounds} round(s), "
            f"{self.steps} training steps in {self.spent_s:.1f} s, costing {self.cost_s:.1f} s "
            f"({self.switching_s:.1f} s switching) of a {self.budget_s:.1f} s budget: {verdict}"
            f"{'' if self.call is not None else ' (not settled)'}"
        )

    def write(self, member: Member, n: int, table: Path) -> None:
        """What the probe learned, as a dispatch table entry at N (see the module's docstring)."""
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
        )  # fmt: skip
        table.parent.mkdir(parents=True, exist_ok=True)
        merge_entries(table, [entry])


def _open(call: Call) -> Call:
    """A call reached before the rule's first look settled nothing: said as open."""
    return call if call.settled else Call("open", call.strategy)


def now() -> float:
    """The run's clock: the device's work finished, then the wall clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
