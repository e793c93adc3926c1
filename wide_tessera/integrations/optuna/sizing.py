"""How many trials of one shape train as one: the user's number, or the dispatch table's (measured
here where it says nothing), capped by memory; and one step's time, for the sequential estimate."""

from __future__ import annotations

import copy
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import psutil
import torch
from torch import nn

from ...api import benchmark_custom
from ...core import trees
from ...dispatch.fuse import DispatchWarning, decide_at
from ...dispatch.table import merge_into
from ...measurement.timing import TimingConfig
from .training import Training, loss_of
from .trial import Member

# the group sizes a measurement tries, at most
_MEASURED_NS = (2, 4, 8, 16, 32, 64)


def size_groups(
    build: Callable[[Dict[str, Any]], nn.Module],
    member: Member,
    training: Training,
    given: Optional[int],
    strategy: Optional[str],
    table: Path,
    n_trials: int,
    device: str,
) -> Tuple[int, str, Optional[str]]:
    """How many trials of this shape train as one, why, and the strategy their groups run (None:
    fuse()'s choice by the table). A given size K runs the strategy given, else the one the table
    names at N=K (measured here where it names none), whatever its verdict: the size asked for is
    the size trained (`group_size=8` alone ran the loop where the verdict at 8 was 'disturbed').
    Where no strategy trains K models correctly, one line says so and the groups run as a loop."""
    cap, memory = _memory_cap(member, training, device)
    if given is not None:
        size = min(given, n_trials)
        capped = f" ({given} given; {n_trials} trials)" if size < given else ""
        why = f"{size}, as given{capped}" + (f" (memory would allow {cap})" if cap < size else "")
        if strategy is not None or size == 1:
            return size, why, strategy
        if _verdicts(member, [size], table)[size][1] == "none":
            _measure(build, member, training, [size], table, device)
        _, verdict, named = _verdicts(member, [size], table)[size]
        if named is None:
            line = f"group_size={given}: no strategy trains N={size} of these models correctly (verdict at N={size}: "
            warnings.warn(f"{line}{verdict}; {table}): its groups run as a loop", DispatchWarning, stacklevel=3)
            return size, f"{why}, as a loop: no strategy ran correctly at N={size}", "loop"
        return size, f"{why}, {named}: the strategy the table names at N={size} ({verdict}; {table})", named
    ns = [n for n in _MEASURED_NS if n <= min(n_trials, cap)]
    if not ns:
        return 1, f"1: {memory} allows one model", strategy
    verdicts = _verdicts(member, ns, table)
    if not any(v in _DECIDED for _, v, _ in verdicts.values()):  # nothing measured, or nothing measured cleanly
        _measure(build, member, training, ns, table, device)
        verdicts = _verdicts(member, ns, table)
    fusing = [n for n, (fuses, _, _) in verdicts.items() if fuses]
    said = ", ".join(f"N={n} {v}" for n, (_, v, _) in verdicts.items())
    if not fusing:
        undecided = not any(v in _DECIDED for _, v, _ in verdicts.values())
        hint = "; on a quieter machine, or with group_size=, it may fuse" if undecided else ""
        return 1, f"1, one trial at a time: no measured N fuses a training step ({said}; {table}){hint}", strategy
    size = max(fusing)
    why = f"{size}: the largest N at which a training step fuses on this machine ({said}; {table}), {memory}"
    return size, why, strategy


# the table's verdicts that decided something (dispatch.table.N_VERDICTS): the others ask to measure again
_DECIDED = ("fuse", "marginal", "same", "loop")


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


def _measure(
    build: Callable[[Dict[str, Any]], nn.Module], member: Member, training: Training, ns: Sequence[int], table: Path,
    device: str,
) -> None:  # fmt: skip
    """benchmark_custom of this model's training step at `ns` (N models built afresh, each its own
    weights), merged into the table."""
    params = member.params
    x, _ = member.draws.batch(training, params, 0, keep=False)
    result = benchmark_custom(
        partial(build, dict(params)),
        None,
        [1, *ns],
        input_factory=lambda: trees.clone(x),
        mode="train",
        confirm="all",  # fuse() fuses N only where every larger measured N fused, confirmed: measure them all
        randomness="different",
        device=device,
        verbose=False,
        timing=TimingConfig(budget_s=0.25),
    )
    table.parent.mkdir(parents=True, exist_ok=True)
    merge_into(table, result)


def _memory_cap(member: Member, training: Training, device: str) -> Tuple[int, str]:
    """How many models' training fits in half the device's free memory: a model's weights,
    gradients and two optimizer moments, and its input and output three times over (forward,
    backward, the packed copy)."""
    x, _ = member.draws.batch(training, member.params, 0, keep=False)
    with torch.no_grad():  # on a copy: a call in train mode moves BatchNorm's statistics
        y = trees.call(copy.deepcopy(member.model), x)
    weights = sum(t.numel() * t.element_size() for t in member.model.state_dict().values())
    io = sum(t.numel() * t.element_size() for t in trees.tensors([x, y]))
    per_model = 4 * weights + 3 * io
    free = torch.cuda.mem_get_info()[0] if torch.device(device).type == "cuda" else psutil.virtual_memory().available
    cap = max(1, int(free / 2 // max(per_model, 1)))
    return cap, f"memory for {cap} ({per_model / 2**20:.1f} MiB a model, {free / 2**30:.1f} GiB free)"


def step_seconds(member: Member, training: Training, device: str) -> float:
    """One training step of one model alone, timed after a first one (on copies)."""
    model = copy.deepcopy(member.model)
    after_backward = training.alone_step(model, member.params)
    times = []
    for step in range(3):
        x, y = member.draws.batch(training, member.params, step % training.steps, keep=False)
        begin = time.perf_counter()
        torch.autograd.backward(loss_of(training, trees.call(model, x), y))
        after_backward()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return min(times[1:])
