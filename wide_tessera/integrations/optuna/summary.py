"""What a study's `optimize` did, as data and in words."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class GroupRecord:
    """One group of trials trained as one: their numbers, N, what ran, for how long, and why."""

    trials: List[int]
    shape: str
    strategy: Optional[str]
    why: str
    seconds: float
    pruned: List[int] = field(default_factory=list)
    repacked: List[int] = field(default_factory=list)  # the group's N after each repack
    failed: List[int] = field(default_factory=list)  # trials whose own code raised: FAIL, alone


@dataclass
class StudySummary:
    """What `optimize` did: the group size and why, per shape; every group; the wall time against
    an estimate of the sequential study (one trial's step timed alone, times every trial's steps),
    and how much of it went to sizing the groups (a probe's switches, and its fused turns' time
    beyond the loop's: each group size's line says what the probe measured and decided)."""

    sizes: Dict[str, str]
    groups: List[GroupRecord]
    seconds: float
    sequential_estimate_s: float
    shape_params: List[str]
    sizing_s: float = 0.0
    pruned_by_suggest: int = 0  # trials whose suggest raised TrialPruned: asked, never trained

    def __str__(self) -> str:
        fused = sum(g.strategy is not None for g in self.groups)
        trained, n_pruned = sum(len(g.trials) for g in self.groups), sum(len(g.pruned) for g in self.groups)
        by_suggest = f" ({self.pruned_by_suggest} by suggest)" if self.pruned_by_suggest else ""
        lines = [
            f"{trained + self.pruned_by_suggest} trials, {trained} in {len(self.groups)} group(s), {fused} of them "
            f"fused, {n_pruned + self.pruned_by_suggest} pruned{by_suggest}; {self.seconds:.1f} s "
            f"(sequential, unpruned, estimated {self.sequential_estimate_s:.1f} s)"
        ]
        if self.sizing_s >= 0.05:
            lines.append(f"of which {self.sizing_s:.1f} s went to sizing the groups (see the group sizes)")
        if self.shape_params:
            lines.append(f"groups told apart by: {', '.join(self.shape_params)}")
        elif len(self.sizes) > 1:
            lines.append(
                f"{len(self.sizes)} shapes, told apart by no one suggested parameter the trials show (one is "
                "named where it is one value within each shape of 2 or more trials)"
            )
        lines += [f"group size for {shape}: {why}" for shape, why in self.sizes.items()]
        for index, g in enumerate(self.groups):
            repacked = f" (repacked to N={', '.join(map(str, g.repacked))})" if g.repacked else ""
            pruned = f", pruned {g.pruned}" if g.pruned else ""
            failed = f", failed {g.failed}" if g.failed else ""
            ran = f"{g.strategy or 'a loop'} ({g.why})"
            lines.append(f"  group {index}: trials {g.trials} as {ran}, {g.seconds:.1f} s{pruned}{failed}{repacked}")
        return "\n".join(lines)


def labels(shapes: Dict[str, List[Dict[str, Any]]], told_apart: List[str]) -> Dict[str, str]:
    """Each shape as a person reads it: the model's class, and the values of the parameters that
    tell the shapes apart (of its first trial); numbered where that names two shapes alike."""
    named = {
        key: " ".join([key[2 : key.index("'", 2)], *(f"{p}={params[0][p]!r}" for p in told_apart)])
        for key, params in shapes.items()  # _shape_key's repr begins with the class's name
    }
    if len(set(named.values())) < len(named):
        return {key: f"{name} (shape {i + 1})" for i, (key, name) in enumerate(named.items())}
    return named


def shape_params(shapes: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    """The suggested parameters whose values tell the groups' shapes apart: one value within each
    shape, different values between them. Only a shape of two trials or more can show a
    parameter is not one (its trials differ in it): where every shape held one trial, every
    parameter passed, and a study told apart by alpha alone said "alpha, lr"."""
    if len(shapes) < 2 or all(len(ps) < 2 for ps in shapes.values()):
        return []
    names = set.intersection(*(set(p) for ps in shapes.values() for p in ps))
    found = []
    for name in sorted(names):
        per_shape = [{repr(p[name]) for p in ps} for ps in shapes.values()]
        if all(len(v) == 1 for v in per_shape) and len(set.union(*per_shape)) > 1:
            found.append(name)
    return found
