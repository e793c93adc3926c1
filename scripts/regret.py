"""How often does a decision cost more than it says, and how long does it take to say it?

The decision rule (results.decisions) stops a point at a look once the worst a wrong choice
can cost beyond the 5% margin is at most ε (`--regret`, 2%). This replays that rule, and the
rule before it (a margin and a marginal zone around it), on rounds that have the drift of
real ones: a few long points of real functions are recorded (interleaved paired rounds of
the project's timer, 400 each), each round's ratio divided by the point's median gives its
noise (`--clock thread` records by the thread's CPU time, for a machine too busy for wall time
to show a quiet run's drift), and each repetition draws 1000 rounds from that noise in blocks of ten consecutive
rounds (so the drift from round to round within a block is kept), times a true speedup T.
The rule looks at 10, 20, 40, ... rounds, at its intervals' level, as a run does.

Per true speedup and rule it prints: P(regret > ε), the chance that the action the rule
settled on costs more than ε beyond the margin (fusing costs 1.05/T - 1, the loop T/1.05 - 1;
a point left open runs as the loop, and is counted in the next column, not this one); P(open
costs > ε), the same for points still open at the budget run as the loop; the mean rounds;
P(open at 160), the chance a point is still open after 160 rounds. Target: P(regret > ε) at
most 2.5% (one-sided) at every T from 0.90 to 1.20.

Then an A/A check on the real timer: pairs of identical functions measured as a point is,
stopping by the rule; none may be answered 'fuse'.

    python scripts/regret.py [--reps 400] [--aa 200] [--clock wall|thread] [--record FILE | --rounds FILE]
                             [--regret 0.02]

`--record FILE` keeps the recorded rounds; `--rounds FILE` replays them instead of recording.
On a busy machine the recorded noise is a busy machine's: say which when quoting the table.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from coverage import pairs  # scripts/ is on the path of a script run from it
from torch import nn

from wide_tessera.core.jsonio import read_json, write_json
from wide_tessera.core.stats import REGRET
from wide_tessera.measurement.settings import RunSettings
from wide_tessera.measurement.timing import TimingConfig, measure_paired
from wide_tessera.reports.text import format_table
from wide_tessera.results.decisions import decide, decision_level, fuse_regret, looks, loop_regret, stop_rule

TRUTHS = (0.90, 0.95, 1.00, 1.03, 1.05, 1.07, 1.10, 1.20)
ROUNDS = 400  # per recorded point
BLOCK = 10
CONFIG = TimingConfig()


def record(clock: str) -> List[List[float]]:
    """Each pair of coverage.py's as one long point: its rounds' ratios baseline / strategy, each
    function run in a loop of at least 1 ms per round, the two in turns (the first alternating).
    By wall time, as the timer measures; or, on a machine whose other processes take the
    cores, by this thread's CPU time, which their time slices do not enter (with one torch
    thread): on a 2-core machine at load 7, wall-time rounds' ratios spread 0.02x to 40x."""
    now = time.perf_counter_ns if clock == "wall" else time.thread_time_ns
    points = []
    with torch.no_grad():
        for _, a, b in pairs():
            calls = {fn: _calls_per_ms(fn, now) for fn in (a, b)}
            ratios = []
            for i in range(ROUNDS):
                took = {}
                for fn in (a, b) if i % 2 == 0 else (b, a):
                    start = now()
                    for _ in range(calls[fn]):
                        fn()
                    took[fn] = (now() - start) / calls[fn]
                ratios.append(took[a] / took[b])
            points.append(ratios)
    return points


def _calls_per_ms(fn: Callable[[], object], now: Callable[[], int]) -> int:
    """Calls of `fn` that take at least 1 ms (warmed up)."""
    calls = 1
    while True:
        start = now()
        for _ in range(calls):
            fn()
        if now() - start >= 1_000_000:
            return calls
        calls *= 2


def replay(points: List[np.ndarray], truth: float, epsilon: Optional[float], rng: np.random.Generator) -> Tuple:
    """One repetition: (kind the rule settled on or 'open', rounds it took, open at 160)."""
    noise = points[rng.integers(len(points))]
    starts = rng.integers(0, len(noise) - BLOCK + 1, CONFIG.max_samples // BLOCK)
    ratios = truth * np.concatenate([noise[s : s + BLOCK] for s in starts])
    base, strategy = np.ones(len(ratios)), 1 / ratios
    level = decision_level(CONFIG)
    for n in [*looks(CONFIG), CONFIG.max_samples]:
        call = decide({"baseline": base[:n], "s": strategy[:n]}, ["s"], level, epsilon=epsilon)
        if call.settled:
            return call.kind, n, n > 160
    return "open", CONFIG.max_samples, True


def cost(kind: str, truth: float) -> float:
    """What the action taken costs beyond the margin: fusing, or the loop (loop, marginal, open)."""
    return fuse_regret(truth) if kind == "fuse" else loop_regret([truth])


def simulate(points: List[np.ndarray], reps: int, epsilon: float) -> List[List[str]]:
    rows = []
    for truth in TRUTHS:
        for rule, eps in (("margin and zone", None), (f"regret {100 * epsilon:g}%", epsilon)):
            rng = np.random.default_rng(0)
            runs = [replay(points, truth, eps, rng) for _ in range(reps)]
            wrong = sum(k != "open" and cost(k, truth) > epsilon for k, _, _ in runs)
            open_wrong = sum(k == "open" and cost(k, truth) > epsilon for k, _, _ in runs)
            rows.append([
                f"{truth:.2f}", rule, f"{wrong / reps:.1%}", f"{open_wrong / reps:.1%}",
                f"{np.mean([n for _, n, _ in runs]):.0f}", f"{np.mean([o for _, _, o in runs]):.2f}",
            ])  # fmt: skip
    return rows


def aa(count: int, epsilon: float) -> Dict[str, int]:
    """Identical functions measured as a point is, stopping by the rule: the kinds they got."""
    torch.manual_seed(0)
    layer, x = nn.Linear(64, 64), torch.randn(8, 64)
    settings = RunSettings(device="cpu", regret=epsilon, timing=TimingConfig(budget_s=0.05))
    stop, level = stop_rule(["b"], [], settings), decision_level(settings.timing)
    kinds: Dict[str, int] = {}
    with torch.no_grad():
        for _ in range(count):
            stats = measure_paired({"baseline": lambda: layer(x), "b": lambda: layer(x)}, config=settings.timing,
                                   stop=stop).stats  # fmt: skip
            samples = {name: st.samples_ms for name, st in stats.items()}
            kind = decide(samples, ["b"], level, epsilon=epsilon).kind
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=400, help="repetitions per true speedup and rule")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall", help="what the recording times by")
    parser.add_argument("--aa", type=int, default=200, help="A/A pairs of identical functions on the real timer")
    parser.add_argument("--regret", type=float, default=REGRET, help="ε")
    parser.add_argument("--threads", type=int, default=1)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--record", metavar="FILE", help="keep the recorded rounds' ratios in FILE")
    source.add_argument("--rounds", metavar="FILE", help="replay the ratios a --record kept, recording none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recorded = read_json(args.rounds, args.rounds, "recorded rounds")["ratios"] if args.rounds else record(args.clock)
    if args.record:
        write_json(args.record, {"ratios": recorded})
    points = [np.asarray(r) / np.median(r) for r in recorded]
    spread = ", ".join(f"{np.percentile(p, 90) / np.percentile(p, 10):.3f}" for p in points)
    print(f"{len(points)} points of {ROUNDS} rounds ({args.clock} clock); p90/p10 of their rounds' ratios: {spread}")
    print(f"{args.reps} repetitions per row, blocks of {BLOCK} rounds, looks at {looks(CONFIG)} and "
          f"{CONFIG.max_samples}, ε = {args.regret:.1%}")  # fmt: skip
    header = ["true speedup", "rule", "P(regret > ε)", "P(open costs > ε)", "mean rounds", "P(open at 160)"]
    print(format_table(header, simulate(points, args.reps, args.regret)))
    if args.aa:
        kinds = aa(args.aa, args.regret)
        print(f"A/A, {args.aa} pairs of identical functions (Linear 64, real timer): "
              + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))  # fmt: skip


if __name__ == "__main__":
    main()
