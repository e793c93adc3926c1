"""The train mode's correctness rule as a decision: how often does it call a correct fused training
incorrect, and how often does it catch a wrong one?

For 3-layer MLPs of several widths and N, and several seeds, `benchmark_custom(mode='train')`
checks vmap and surgery (each trained with wide_tessera.optim.AdamW, per-model settings drawn
per point, per-model clipping and schedule) against N separate torch trainings after 10 steps
(core.correctness.check_trained, with the separate trainings' rounding twin), as it is and
with the fused side's optimizer mutated three ways: one learning rate for all models, a joint
clip over all models' gradients, and a lost step. Target: no correct strategy called incorrect,
every mutation caught.

    taskset -c 1 python scripts/trained_check.py [--hidden 64,256] [--n-values 4,32] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from train_speed import MLP  # the same MLP as the speed script (scripts/ is the path of a script run there)

import wide_tessera as wt
import wide_tessera.optim as wto
from wide_tessera.reports.text import format_table

ADAMW = wto.AdamW


class LosingTheFifthStep(ADAMW):
    def step(self, closure: Any = None) -> Any:
        self.calls = getattr(self, "calls", 0) + 1
        return None if self.calls == 5 else super().step(closure)


MUTATIONS: Dict[str, Optional[Tuple[str, Callable[..., Any]]]] = {
    "correct": None,
    "one lr for all": ("AdamW", lambda module, lr, **k: ADAMW(module, lr=lr[0], **k)),
    "a joint clip": ("clip_grad_norm_", lambda m, limit: torch.nn.utils.clip_grad_norm_(m.parameters(), limit)),
    "a lost step": ("AdamW", LosingTheFifthStep),
}


@contextmanager
def mutated(mutation: str) -> Iterator[None]:
    change = MUTATIONS[mutation]
    if change is None:
        yield
        return
    name, replacement = change
    original = getattr(wto, name)
    setattr(wto, name, replacement)
    try:
        yield
    finally:
        setattr(wto, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="64,256")
    parser.add_argument("--n-values", default="4,32")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts: Dict[str, Dict[str, int]] = {m: {"checks": 0, "incorrect": 0} for m in MUTATIONS}
    rows = []
    for hidden in [int(h) for h in args.hidden.split(",")]:
        for n in [int(v) for v in args.n_values.split(",")]:
            for seed in [int(s) for s in args.seeds.split(",")]:
                for mutation in MUTATIONS:
                    with mutated(mutation):
                        result = wt.benchmark_custom(
                            MLP, (args.batch, hidden), [n], model_kwargs=dict(d=hidden, hidden=hidden),
                            mode="train", seed=seed, verbose=False, confirm="none", controls=False,
                            timing=wt.TimingConfig(budget_s=0.01, min_samples=3),
                        )  # fmt: skip
                    (point,) = result.points
                    for strategy in ("vmap", "surgery"):
                        check = point.checks.get(strategy)
                        if check is None:
                            rows.append([str(hidden), str(n), str(seed), mutation, strategy, "not checked", ""])
                            continue
                        counts[mutation]["checks"] += 1
                        counts[mutation]["incorrect"] += not check.correct
                        verdict = "correct" if check.correct else "INCORRECT"
                        why = (check.error or "")[:90]
                        rows.append([str(hidden), str(n), str(seed), mutation, strategy, verdict, why])
    print(format_table(["hidden", "N", "seed", "fused side", "strategy", "verdict", "why"], rows))
    print()
    summary = [
        [m, str(c["checks"]), str(c["incorrect"]), "false alarms" if m == "correct" else "caught"]
        for m, c in counts.items()
    ]
    print(format_table(["fused side", "checks", "called incorrect", "which is"], summary))


if __name__ == "__main__":
    main()
