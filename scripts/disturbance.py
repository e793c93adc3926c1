"""How often the disturbance rule cries wolf on a quiet machine, and how often it catches a round that lost time.

    python scripts/disturbance.py [--rounds 300] [--threads T] [--loads 0,1,2]

For each load (K processes beside it that each keep a CPU busy), rounds of three
workloads are timed as the timer times them (a round: one sample of a loop of N
small linears, then one of the bmm that fuses them, each sample at least 1 ms),
and the health monitor measures each round's lost fraction: the share of the round
its most delayed thread spent runnable but not running (HealthMonitor.round_lost).
A round *lost time* when it took more than 5% longer than the quiet run's median
round of the same workload. For each candidate threshold of the rule ("disturbed
when the lost fraction exceeds it") the table gives the share of rounds called
disturbed, the false alarms (rounds called disturbed that did not lose time), and
the share of the rounds that lost time that it catches (the detection rate). A
"quiet" machine still runs other things now and then: the rounds they slow down
are disturbed, truly, and a false alarm is a round called disturbed that ran at
its normal speed.

A second table names who took the CPU in the quiet rounds the rule calls disturbed:
around every round the script reads the run time of every other thread on the
machine (/proc/*/task/*/schedstat, outside the timed round), and a disturbed round
is *explained* when one other thread ran at least half as long as this process's
most delayed thread waited. A quiet round called disturbed that nothing explains
is the rule's false alarm in the strict sense.

Targets (issue 38): at most 1% false alarms on a quiet machine; with one busy
process, at least 90% of the rounds that lost more than 5% caught.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import sys
import time
from typing import Callable, Counter, Dict, List, NamedTuple, Optional, Tuple

import torch
from repeatability import cpu_burners  # scripts/ is on the path of a script run from it

from wide_tessera.measurement.health import MAX_LOST_FRACTION, HealthMonitor
from wide_tessera.measurement.timing import TimingConfig, _CpuSampler
from wide_tessera.reports.text import format_table

THRESHOLDS = (0.01, 0.02, 0.05, 0.1)  # the rule's own, MAX_LOST_FRACTION, among them
LOST = 0.05


def workloads() -> Dict[str, Tuple[Callable[[], object], Callable[[], object]]]:
    """name: (N separate linears, one bmm): rounds of about 2, 8 and 40 ms."""
    torch.manual_seed(0)
    cases = {}
    for n, tokens, d in ((8, 64, 64), (8, 256, 256), (16, 512, 256)):
        x, w = torch.randn(n, tokens, d), torch.randn(n, d, d)
        cases[f"N={n} {tokens}x{d}"] = (
            lambda x=x, w=w: [x[i] @ w[i] for i in range(len(w))],
            lambda x=x, w=w: torch.bmm(x, w),
        )
    return cases


Threads = Dict[str, float]  # by /proc path: run time so far in s


class Round(NamedTuple):
    duration_s: float
    lost: float  # the most delayed thread's wait, as a fraction of the round (HealthMonitor.round_lost)
    other: Optional[str]  # the other thread that ran longest during the round, with its run time
    other_s: float


def other_threads_s() -> Threads:
    """Every other process's threads' run time so far (s), by /proc path."""
    own = f"/proc/{os.getpid()}/"
    ran = {}
    for path in glob.glob("/proc/[0-9]*/task/[0-9]*/schedstat"):
        if path.startswith(own):
            continue
        try:
            with open(path) as f:
                ran[path] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # a thread that has just ended
            continue
    return ran


def longest_other(before: Threads, after: Threads) -> Tuple[Optional[str], float]:
    """The name of the other thread that ran longest between the two readings, and how long (s):
    the name is read for that thread alone, not for every thread every round."""
    ran = {path: s - before.get(path, 0.0) for path, s in after.items()}
    path = max(ran, key=ran.__getitem__, default=None)
    if path is None or ran[path] <= 0:
        return None, 0.0
    try:
        with open(path.replace("schedstat", "comm")) as f:
            return f.read().strip(), ran[path]
    except OSError:  # it ended since
        return "(ended)", ran[path]


def rounds_of(fns: Tuple[Callable[[], object], Callable[[], object]], count: int) -> List[Round]:
    """`count` rounds, as the timer takes them."""
    sampler = _CpuSampler(TimingConfig())
    for i, fn in enumerate(fns):
        sampler.prepare(str(i), fn)
    monitor = HealthMonitor("cpu")
    seen = []
    for r in range(count):
        others = other_threads_s()
        monitor.round_started()
        started = time.perf_counter()
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            sampler.sample(str(i))
        duration = time.perf_counter() - started
        lost = monitor.round_lost()
        if lost is None:
            sys.exit("disturbance: this machine has no Linux schedstat; the rule falls back to counting switches")
        seen.append(Round(duration, lost, *longest_other(others, other_threads_s())))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="rounds per workload and load")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument("--loads", default="0,1,2", help="numbers of busy processes, 0 first")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loads = [int(k) for k in args.loads.split(",")]
    if loads[0] != 0:
        sys.exit("disturbance: --loads must start with 0: the quiet rounds are what 'lost time' is measured against")
    cases = workloads()
    quiet: Dict[str, float] = {}
    rows = []
    quiet_disturbed: List[Round] = []
    for k in loads:
        with cpu_burners(k):
            time.sleep(0.2 if k else 0.0)  # the busy processes running before the first round
            seen = {name: rounds_of(fns, args.rounds) for name, fns in cases.items()}
        if k == 0:
            quiet = {name: statistics.median(r.duration_s for r in s) for name, s in seen.items()}
            quiet_disturbed = [r for s in seen.values() for r in s if r.lost > MAX_LOST_FRACTION]
        all_rounds = [(r.duration_s / quiet[name] - 1, r.lost) for name, s in seen.items() for r in s]
        lost_time = [lost for slower, lost in all_rounds if slower > LOST]
        row = [str(k), str(len(all_rounds)), f"{len(lost_time)} ({len(lost_time) / len(all_rounds):.0%})"]
        for t in THRESHOLDS:
            flagged = sum(lost > t for _, lost in all_rounds) / len(all_rounds)
            false = sum(lost > t and slower <= LOST for slower, lost in all_rounds) / len(all_rounds)
            caught = f"{sum(lost > t for lost in lost_time) / len(lost_time):.0%}" if lost_time else "-"
            row.append(f"{flagged:.1%} / {false:.1%} / {caught}")
        rows.append(row)
    print(f"torch threads {args.threads}, {args.rounds} rounds per workload, workloads: {', '.join(cases)}")
    print(f"a round lost time when it took more than {LOST:.0%} longer than the quiet median; the rule now: "
          f"disturbed above {MAX_LOST_FRACTION:.0%}")
    header = ["busy processes", "rounds", f"lost > {LOST:.0%}"]
    header += [f"above {t:.0%}: disturbed / false / caught" for t in THRESHOLDS]
    print(format_table(header, rows))
    print()
    explained = [r for r in quiet_disturbed if r.other_s >= 0.5 * r.lost * r.duration_s]
    who: Counter[str] = collections.Counter(r.other or "" for r in explained)
    print(f"quiet rounds called disturbed: {len(quiet_disturbed)} of {len(cases) * args.rounds}; explained by another "
          f"thread running at least half the wait: {len(explained)}; unexplained (false alarms): "
          f"{len(quiet_disturbed) - len(explained)}")
    rows = [[name, str(count), f"{statistics.median(r.other_s for r in explained if r.other == name) * 1e3:.2f}"]
            for name, count in who.most_common()]  # fmt: skip
    if rows:
        print(format_table(["the other thread", "rounds", "its median run time in the round (ms)"], rows))


if __name__ == "__main__":
    main()
