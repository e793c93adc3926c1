"""How many trials of one shape train as one: the user's number, or the dispatch table's (probed on
the first group where it says nothing), capped by memory; and one step's time, for the sequential
estimate."""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import psutil
import torch

from ...core import trees
from ...dispatch.fuse import DispatchWarning, decide_at
from ...dispatch.table import SETTLED_VERDICTS
from ...train.memory import bytes_per_model
from .probe import Probe
from .sequential import step_alone
from .training import Training, on_device
from .trial import Member

# the group sizes a measurement tries, at most
_MEASURED_NS = (2, 4, 8, 16, 32, 64)


@dataclass
class Sizing:
    """How the trials of one shape train: the group size, why, the strategy their groups run (None:
    fuse()'s choice by the table), and the probe the first group runs where the table decides
    nothing (probe.Probe: the group then starts as the loop)."""

    size: int
    why: str
    strategy: Optional[str] = None
    probe: Optional[Probe] = None
    given: bool = False  # the caller's size: kept whatever the probe decides, and from the first trial


def size_groups(
    member: Member,
    training: Training,
    given: Optional[int],
    strategy: Optional[str],
    table: Path,
    n_trials: int,
    device: str,
    share: float,
    each_s: float,
) -> Sizing:
    """How the trials of this shape train. A given size K runs the strategy given, else the one the
    table names at N=K whatever its verdict (`group_size=8` alone ran the loop where the verdict
    at 8 was 'disturbed'), probed on the first group where the table has nothing at K; where no
    strategy trains K models correctly, one line says so and the groups run as a loop. Without a
    size: the largest N the table says fuses, capped by memory; where it decides nothing, the
    largest N memory allows, probed on the first group within `share` of the study's time
    (probe.Probe; `each_s`: one model's step alone; 0: one trial at a time)."""
    estimate_s = each_s * training.steps * n_trials

    def probe(given: bool = False) -> Probe:
        return Probe.planned(share, each_s, training.steps, estimate_s, switch_costs(member, table), given)

    cap, memory = _memory_cap(member, training, device)
    if given is not None:
        size = min(given, n_trials)
        capped = f" ({given} given; {n_trials} trials)" if size < given else ""
        why = f"{size}, as given{capped}" + (f" (memory would allow {cap})" if cap < size else "")
        if strategy is not None or size == 1:
            return Sizing(size, why, strategy, given=True)
        _, verdict, named = _verdicts(member, [size], table)[size]
        if verdict == "none" and share > 0:
            return Sizing(size, f"{why}, the strategy probed on its first group", "loop", probe(given=True), given=True)
        if named is None:
            cannot = (
                f"the table names no strategy at N={size} and sizing_share=0" if verdict == "none" else
                f"no strategy trains N={size} of these models correctly (verdict at N={size}: {verdict}; {table})"
            )  # fmt: skip
            warnings.warn(f"group_size={given}: {cannot}: its groups run as a loop", DispatchWarning, stacklevel=3)
            return Sizing(size, f"{why}, as a loop: {cannot}", "loop", given=True)
        return Sizing(
            size, f"{why}, {named}: the strategy the table names at N={size} ({verdict}; {table})", named, given=True
        )
    ns = [n for n in _MEASURED_NS if n <= min(n_trials, cap)]
    if not ns:
        return Sizing(1, f"1: {memory} allows one model", strategy)
    verdicts = _verdicts(member, ns, table)
    said = ", ".join(f"N={n} {v}" for n, (_, v, _) in verdicts.items())
    if not any(v in SETTLED_VERDICTS for _, v, _ in verdicts.values()):  # nothing measured, or nothing settled
        if share <= 0:
            return Sizing(1, f"1, one trial at a time: the table decides nothing ({said}) and sizing_share=0")
        return Sizing(ns[-1], f"{ns[-1]}, probed on its first group ({said}; {table}), {memory}", "loop", probe())
    fusing = [n for n, (fuses, _, _) in verdicts.items() if fuses]
    if not fusing:
        return Sizing(1, f"1, one trial at a time: no measured N fuses a training step ({said}; {table})", strategy)
    size = max(fusing)
    why = f"{size}: the largest N at which a training step fuses on this machine ({said}; {table}), {memory}"
    return Sizing(size, why, strategy)


def probed(sizing: Sizing, member: Member, table: Path) -> Sizing:
    """The sizing of a shape once its first group's probe has decided (written to the table): its
    size and the winner, or where the loop won or nothing settled, one trial at a time (a size
    given stays, as a loop)."""
    probe = sizing.probe
    assert probe is not None
    probe.write(member, table)
    winner = probe.winner()
    if winner is None and not sizing.given:
        return Sizing(1, f"1, one trial at a time after group 0: {probe.said()}")
    return Sizing(sizing.size, f"{sizing.size}, {probe.said()}", winner or "loop", given=sizing.given)


def switch_costs(member: Member, table: Path) -> Dict[str, float]:
    """What switching a probe into each strategy cost for this model, as the table's newest entry
    that says (an earlier study's probe, in this process or another)."""
    match, _ = decide_at(member.model, 2, table, mode="train")
    said = sorted((e for e in match.entries if e.switch_s), key=lambda e: e.measured_at)
    return dict(said[-1].switch_s) if said else {}


def _verdicts(member: Member, ns: Sequence[int], table: Path) -> Dict[int, Tuple[bool, str, Optional[str]]]:
    """What the table says of a training step of N of this model at each of `ns`: whether fuse()
    fuses N of them (its rule: the measured N deciding N fused, and every larger measured N), the
    verdict measured at that N (else at the nearest N measured; 'none' where the table has no
    entry) and the strategy it names
    (the winner's, or the best correct one's; None where none ran correctly)."""
    out = {}
    for n in ns:
        match, _ = decide_at(member.model, n, table, mode="train")
        measured = [v for e in match.entries for v in e.verdicts]
        at_n = [v for v in measured if v.n == n] or [v for v in measured if v.n == match.measured_n]
        out[n] = (match.fuse, at_n[0].verdict, at_n[0].strategy) if at_n else (match.fuse, "none", None)
    return out


def _memory_cap(member: Member, training: Training, device: str) -> Tuple[int, str]:
    """How many models' training fits in half the device's free memory (train.bytes_per_model)."""
    per_model = _bytes_per_model(member, training)
    free = torch.cuda.mem_get_info()[0] if torch.device(device).type == "cuda" else psutil.virtual_memory().available
    cap = max(1, int(free / 2 // max(per_model, 1)))
    return cap, f"memory for {cap} ({per_model / 2**20:.1f} MiB a model, {free / 2**30:.1f} GiB free)"


def _bytes_per_model(member: Member, training: Training) -> int:
    x, _ = member.draws.batch(training, member.params, 0, keep=False)
    with torch.no_grad():  # on a copy: a call in train mode moves BatchNorm's statistics
        y = trees.call(copy.deepcopy(member.model), x)
    return bytes_per_model(member.model, x, y, training.optimizer)


def step_seconds(member: Member, training: Training, device: str) -> float:
    """One training step of one model alone as the sequential loop takes it (its batch drawn, its
    loss read), the median of four after a first one (on copies): the fastest of two, without the
    batch, put a small model's sequential study at a quarter of its time, and the sizing share
    with it."""
    model = copy.deepcopy(member.model)
    after_backward = training.alone_step(model, member.params)
    times = []
    for step in range(5):
        begin = time.perf_counter()
        batch = member.draws.batch(training, member.params, step % training.steps, keep=False)
        step_alone(training, model, after_backward, on_device(device, batch))
        times.append(time.perf_counter() - begin)
    return sorted(times[1:])[len(times[1:]) // 2]
