"""Does a preset give the same crossovers twice, and does a busy machine get flagged instead of believed?

Runs the same preset twice back to back, each time every op in one run as the main job
runs them (every first pass before any confirmation): the first run on a quiet machine,
the second with K processes burning a CPU each beside it (`--load K`; 0 runs both
quietly). Per op, each parameter group is counted as agreeing (the same
crossover in both runs, where a crossover with marginal points is the range of Ns it
could be: "fuse from N=8; N=4 marginal" is 4 to 8, and ranges that overlap agree; only a
true marginal point, its interval within the zone, widens the range (reports.answer.
crossover_range): the points that issue 48 found called marginal over 0.78x to 1.54x are open
now, and a crossover that moves across an undecided point is flagged, not agreeing; a
crossover that is "not known", its largest N undecided, agrees with nothing), flagged
(a run says why a decision there could flip: a deciding point disturbed and never measured
clean, passes that contradict each other, a decision still open), or a *confident
disagreement* (a different crossover that neither run flags): the one outcome a user could
be misled by. Each run uses the decision rule with confirmation, as the quick preset does
(--precise: sampling to 2% medians instead).
Target: at least 90% agreement quietly; under load no confident disagreement.

    python scripts/repeatability.py [--preset quick] [--device cpu] [--load K] [--threads T] [ops ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator, List

import torch

from wide_tessera.api import build_job
from wide_tessera.measurement.settings import RunSettings
from wide_tessera.ops.registry import op_names
from wide_tessera.reports.answer import crossover_known, crossovers_agree
from wide_tessera.reports.text import format_table
from wide_tessera.results.schema import BenchmarkResult
from wide_tessera.sweep.runner import JobRun, run_jobs


@contextmanager
def cpu_burners(k: int) -> Iterator[None]:
    """K processes that each keep one CPU busy, for as long as the block runs.

    They are started through a shell that exits at once, so they are not this process's
    children: a child's CPU time counts as the run's own (as torch.compile's workers' does),
    and burners started as children kept the health monitor from seeing any load, every
    point of `coverage.py --load 1` reading 0.00 to 0.07 other cores (2026-11-25). Not being
    children, they would outlive a kill -9 of the script and load every later measurement, so
    each one checks every quarter second or so that the script is still there."""
    burn = f"import os\nwhile True:\n    for _ in range(10**7): pass\n    os.kill({os.getpid()}, 0)"
    spawn = f'"{sys.executable}" -c "{burn}" >/dev/null 2>&1 & echo $!'
    pids = [int(subprocess.check_output(["sh", "-c", spawn])) for _ in range(k)]
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)


def run_together(ops: List[str], preset: str, settings: RunSettings) -> List[BenchmarkResult]:
    """The ops in one run, as the main job runs them: every first pass before any confirmation."""
    assert settings.device is not None  # RunSettings resolves it
    jobs = [build_job(op, preset, settings.device, {}, verbose=False) for op in ops]
    return list(run_jobs([JobRun(job, settings) for job in jobs]))


def _speedup(point) -> str:
    best = point.best_strategy
    if best is None or best not in point.speedup_ci:
        return "no timed correct strategy"
    low, high = point.speedup_ci[best]
    return f"{best} {point.speedups[best]:.2f}x [{low:.2f},{high:.2f}] ({point.winner})"


def _disagreement(first, second, params) -> List[str]:
    """The points where one run won and the other did not."""
    a = [p for p in first.points if p.params == params]
    b = [p for p in second.points if p.params == params]
    return [f"N={pa.n}: {_speedup(pa)} vs {_speedup(pb)}" for pa, pb in zip(a, b) if pa.fused_wins != pb.fused_wins]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="*")
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--precise", action="store_true", help="sample to 2%% medians, not to the decision")
    parser.add_argument("--device", default=None)
    parser.add_argument("--load", type=int, default=0, metavar="K", help="busy processes beside the second run")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads  [default: torch's choice]")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, why = [], []
    totals = {"groups": 0, "agree": 0, "flagged": 0, "confident": 0}
    # the preset's settings, as the main job runs it, but always confirming (the ci preset alone
    # would not): what is under test is the confirmation and the flags. The controls decide no
    # crossover; they are timed where the preset times them.
    settings = RunSettings.of(preset=args.preset, device=args.device, confirm="deciding", precise=args.precise)
    ops = args.ops or op_names()
    firsts = run_together(ops, args.preset, settings)
    with cpu_burners(args.load):
        seconds = run_together(ops, args.preset, settings)
    for op, first, second in zip(ops, firsts, seconds):
        agreed = flagged = confident = 0
        for a, b in zip(first.groups, second.groups):
            same = crossover_known(a) and crossover_known(b) and crossovers_agree(first, a, second, b)
            if same:
                agreed += 1
            elif a.problems or b.problems:
                flagged += 1
            else:
                confident += 1
            if not same:
                mark = "flagged" if a.problems or b.problems else "CONFIDENT DISAGREEMENT"
                why += [f"  {op} {mark}: {line}" for line in _disagreement(first, second, a.params)]
        n = len(first.groups)
        for key, value in zip(totals, (n, agreed, flagged, confident)):
            totals[key] += value
        rows.append(
            [op, str(n), str(agreed), str(flagged), str(confident), f"{first.crossover_n} / {second.crossover_n}",
             "yes" if second.reliable else "no"]
        )
    print(
        f"preset {args.preset}, device {first.device}, {torch.get_num_threads()} thread(s), "
        f"load {args.load} busy process(es) during the second run"
    )
    header = ["op", "groups", "agree", "differ, flagged", "differ, confident", "crossover_n 1 / 2", "run 2 reliable"]
    print(format_table(header, rows))
    ok = totals["agree"] + totals["flagged"]
    print(
        f"overall: {totals['agree']}/{totals['groups']} agree, {totals['flagged']} flagged, "
        f"{totals['confident']} confident disagreement(s); agree or flagged {ok / totals['groups']:.0%}"
    )
    if why:
        print("where the runs differ (best strategy's speedup [95% CI], run 1 vs run 2):")
        print("\n".join(why))


if __name__ == "__main__":
    main()
