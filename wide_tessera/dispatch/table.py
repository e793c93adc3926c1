"""The dispatch table: measured fusion verdicts per op, device, dtype and parameters, and the
rule that picks the entry deciding a new case.

`wide_tessera tune` (and `benchmark --save-dispatch`) writes it from results; `wide_tessera.fuse`
reads it. Nothing here knows any op: an entry is an op's name and a parameter group's values.

Only a win that was significant *and confirmed* (the confirmation pass measured the point
again and agreed) enters a table as `fuse`: a table decides what runs in users' models, and
an unconfirmed win on a shared machine did not always survive a second measurement (the
trust issue's UNSTABLE points).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from dataclasses_json import dataclass_json

from ..core.capabilities import Needs, unmet_need
from ..core.errors import WideTesseraError
from ..core.files import cache_dir, results_lock, results_target
from ..core.job import MAX_N, params_text
from ..core.jsonio import load_document, write_json
from ..core.user_input import MAX_THREADS, check_number
from ..reports.answer import n_or_never
from ..results.analysis import group_crossover, parameter_groups
from ..results.manifest import now
from ..results.schema import MARGINAL, NO_DIFFERENCE, OPEN, BenchmarkResult, PointResult

__all__ = [
    "NVerdict",
    "KIND",
    "DispatchEntry",
    "DispatchTable",
    "Case",
    "Match",
    "default_table_path",
    "check_table_target",
    "merge_into",
    "merge_entries",
    "TABLE_WAIT_S",
    "entries_of",
    "match",
    "decide",
    "measured_entry",
    "N_VERDICTS",
    "LOOP_VERDICTS",
    "SETTLED_VERDICTS",
    "MAX_RATIO",
    "TABLE_ENV",
]

FORMAT = "wide_tessera dispatch table"
KIND = f"a {FORMAT}"  # what a table file holds, in the words of files.results_target
VERSION = 1
TABLE_ENV = "WIDE_TESSERA_DISPATCH"
# The preset of an entry that fuse(measure='first-call') measured on the modules' first call.
FIRST_CALL = "first call"

# What a measured N says. Only 'fuse' lets a module fuse at that N.
#   fuse: a strategy was significantly faster, and the confirmation pass agreed
#   unconfirmed: it was faster, but nothing measured it again (--confirm none or deciding)
#   marginal: fusing gains about the margin (results.decisions): kept apart from wins, it does not fuse
#   same: no significant difference; loop: the N separate calls were faster (or no strategy was correct)
#   open: undecided at the budget or over its passes; unstable: the passes contradicted each other; disturbed: the
#   measurement could not be cleaned; failed: no measurement
N_VERDICTS = ("fuse", "unconfirmed", "marginal", "same", "loop", "open", "unstable", "disturbed", "failed")
# The verdicts that keep the N separate calls: they were measured as fast as any strategy.
LOOP_VERDICTS = ("marginal", "same", "loop")
# The verdicts that settled a measured N one way or the other; the rest ask to measure it again.
SETTLED_VERDICTS = ("fuse", *LOOP_VERDICTS)

# A measured entry decides a case only when every size axis is within this factor of the
# case's: a crossover measured at batch 16 says little about batch 4096.
MAX_RATIO = 4.0


@dataclass_json
@dataclass(frozen=True)
class NVerdict:
    """One measured N: its verdict (N_VERDICTS) and, for a fused win, the winning strategy with its
    speedup and 95% interval (for the other verdicts, the best correct strategy's, where one ran)."""

    n: int
    verdict: str
    strategy: Optional[str] = None
    speedup: Optional[float] = None
    speedup_ci: Optional[List[float]] = None


@dataclass(frozen=True)
class Setting:
    """What an entry and a case share: the op, the device, the dtype, how one timed call ran
    (the benchmark's --mode, --compile, --cuda-graph), and the parameters."""

    op: str
    device: str
    device_name: str
    dtype: str
    mode: str
    compile: str
    cuda_graph: bool
    params: Dict[str, Any]


@dataclass_json
@dataclass(frozen=True)
class DispatchEntry(Setting):
    """One op's parameter group measured on one device: its verdict at every measured N.

    device: 'cpu' or 'cuda'; device_name: the CPU model or GPU name. params: every sweep axis
    but dtype and N. mode, compile, cuda_graph: how one timed call ran (the benchmark's
    --mode, --compile, --cuda-graph). crossover_n: the smallest measured N from which every
    measured N is 'fuse' (None when the largest is not). measured_at: when the run ended
    (UTC); a newer measurement of the same entry replaces an older one. threads: torch's CPU threads.
    """

    verdicts: List[NVerdict]
    crossover_n: Optional[int]
    measured_at: str
    versions: Dict[str, Optional[str]]
    threads: int
    preset: str
    run_id: Optional[str] = None
    # what switching an Optuna study's probe into each strategy cost (its build and first step
    # beyond a loop step), the last measured: a later study, in any process, predicts its switches
    # by it, and tries the strategies no study has switched into yet
    switch_s: Dict[str, float] = field(default_factory=dict)

    def key(self) -> str:
        """What makes two entries the same measurement (one replaces the other)."""
        return json.dumps([*_setting_key(self), self.params], sort_keys=True)

    def describe(self) -> str:
        where = f"on {self.device_name} ({self.measured_at})"
        return f"{self.op} {params_text(self.params)} dtype={self.dtype} mode={self.mode} {where}"


@dataclass_json
@dataclass
class DispatchTable:
    """Every entry measured: plain JSON, written by `wide_tessera tune`, read by `wide_tessera.fuse`."""

    entries: List[DispatchEntry] = field(default_factory=list)
    format: str = FORMAT
    version: int = VERSION

    def __post_init__(self) -> None:
        """Every table is checked where it is made: read from a file, given to fuse() or
        register() as an object, or merged; what the check refuses is never trusted."""
        _check_entries_are(self.entries, "DispatchTable")
        _check_entries(self)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "DispatchTable":
        """Read a table; a missing, damaged or foreign file is one WideTesseraError naming it."""
        if not isinstance(path, (str, Path)):
            raise WideTesseraError(f"DispatchTable.load: path={path!r}: give the path of a dispatch table")
        return load_document(
            path,
            DispatchTable,
            FORMAT,
            VERSION,
            f"dispatch table {path}",
            "a wide_tessera dispatch table",
        )

    def save(self, path: Union[str, Path]) -> None:
        _check_entries_are(self.entries, "DispatchTable.save")
        _check_entries(self)  # what load would refuse is never written
        write_json(path, self.to_dict(), KIND)  # type: ignore[attr-defined]  # dataclass_json adds it

    def merged(self, entries: Sequence[DispatchEntry]) -> "DispatchTable":
        """This table with `entries` added; of two measurements of one entry the newer is kept."""
        _check_entries_are(entries, "DispatchTable.merged")
        by_key = {e.key(): e for e in self.entries}
        for e in entries:
            old = by_key.get(e.key())
            if old is None or e.measured_at >= old.measured_at:  # ISO 8601 in UTC: text order is time order
                by_key[e.key()] = e
        return DispatchTable(sorted(by_key.values(), key=lambda e: (e.op, e.device_name, e.dtype, e.key())))


def _check_entries_are(entries: Any, what: str) -> None:
    if not isinstance(entries, (list, tuple)) or not all(isinstance(e, DispatchEntry) for e in entries):
        raise WideTesseraError(
            f"{what}: entries={entries!r:.60}: give a list of DispatchEntry (entries_of(result) makes them)"
        )


def _check_entries(table: DispatchTable) -> None:
    for i, entry in enumerate(table.entries):
        _check_entry(entry, f"entries[{i}]")


def _check_entry(entry: DispatchEntry, where: str) -> None:
    """What must hold of an entry for its verdicts to be trusted: a table edited by hand or damaged
    gave fuse() an IndexError (an interval of one element), a speedup of -2 in [3, -5] "won ...
    confirmed", and took N = 10**30, threads = -1 and measured_at "yesterday"."""
    where = f"{where} ({entry.op})"
    ns = [v.n for v in entry.verdicts]
    if not ns or any(n <= 0 for n in ns) or ns != sorted(set(ns)) or ns[-1] > MAX_N:
        raise WideTesseraError(
            f"{where}: verdicts must be for distinct N from 1 to {MAX_N} in increasing order, got N={ns}"
        )
    for v in entry.verdicts:
        if v.verdict not in N_VERDICTS:
            raise WideTesseraError(f"{where}: N={v.n}: verdict {v.verdict!r} (valid: {', '.join(N_VERDICTS)})")
        if v.verdict == "fuse" and not v.strategy:
            raise WideTesseraError(f"{where}: N={v.n}: a 'fuse' verdict names no strategy")
        _check_speedup(v, f"{where}: N={v.n}")
    if entry.crossover_n != _crossover(entry.verdicts):
        raise WideTesseraError(f"{where}: crossover_n {entry.crossover_n} does not follow from its verdicts")
    check_number(f"{where}: threads", entry.threads, 1, MAX_THREADS, integer=True, low_ok=True)
    for strategy, seconds in entry.switch_s.items():
        check_number(f"{where}: switch_s[{strategy!r}]", seconds, 0, math.inf, low_ok=True)
    try:
        datetime.datetime.fromisoformat(entry.measured_at)
    except (TypeError, ValueError):
        raise WideTesseraError(
            f"{where}: measured_at {entry.measured_at!r}: give a time in ISO 8601, e.g. 2026-11-28T16:05:00+00:00"
        ) from None


def _check_speedup(v: NVerdict, where: str) -> None:
    """A speedup is a positive ratio, and its interval [low, high] holds it."""
    if v.speedup is not None and not v.speedup > 0:
        raise WideTesseraError(f"{where}: speedup {v.speedup!r}: give a positive ratio")
    ci = v.speedup_ci
    if ci is None:
        return
    if len(ci) != 2 or not 0 <= ci[0] <= ci[1]:
        raise WideTesseraError(f"{where}: speedup_ci {ci!r}: give [low, high], 0 <= low <= high")
    if v.speedup is not None and not ci[0] * (1 - 1e-9) <= v.speedup <= ci[1] * (1 + 1e-9):
        raise WideTesseraError(f"{where}: speedup {v.speedup!r} is outside its interval {ci!r}")


def _crossover(verdicts: Sequence[NVerdict]) -> Optional[int]:
    return group_crossover([(v.n, v.verdict == "fuse") for v in verdicts])


def default_table_path() -> Path:
    """$WIDE_TESSERA_DISPATCH, else the per-user cache's dispatch.json (see files.cache_dir)."""
    return Path(os.environ.get(TABLE_ENV) or cache_dir() / "dispatch.json")


def check_table_target(path: str, output: Optional[str]) -> None:
    """The table a run merges into: a regular file or none yet, not the results file, and, where
    it exists, a table (a damaged one is not overwritten: it may hold other measurements)."""
    try:
        results_target(path, KIND)
    except WideTesseraError as e:
        raise WideTesseraError(f"dispatch table {e}") from None
    if output and Path(output).resolve() == Path(path).resolve():
        raise WideTesseraError(f"dispatch table {path}: is the results file too; give another file")
    if Path(path).exists():
        DispatchTable.load(path)


# How long a writer of a table waits for another's merge. Every writer (tune, --save-dispatch,
# a first call, a study sizing its groups) holds the lock only to read, merge and write the file,
# milliseconds; a writer that held it for a whole run made every first call meanwhile drop its
# measurement (12 of 12 while tune ran, 10 of 24 between two processes of first calls).
TABLE_WAIT_S = 10.0


def merge_entries(path: Union[str, Path], entries: Sequence[DispatchEntry]) -> None:
    """Merge `entries` into the table at `path` under its lock (waiting up to TABLE_WAIT_S for
    another writer's merge), so that no writer's entries replace another's."""
    with results_lock(path, wait_s=TABLE_WAIT_S):
        table = DispatchTable.load(path) if Path(path).exists() else DispatchTable()
        table.merged(entries).save(path)


def merge_into(path: Union[str, Path], result: BenchmarkResult) -> str:
    """Merge `result`'s entries into the table at `path`; what was merged, in one line, or why
    nothing was: an op whose run stopped early is left out (said, not left out silently)."""
    if not result.complete:
        return (
            f"dispatch table {path}: {result.op} not merged: its run stopped before every point was measured; "
            f"tune {result.op} again"
        )
    entries = entries_of(result)
    merge_entries(path, entries)
    unconfirmed = sum(v.verdict == "unconfirmed" for e in entries for v in e.verdicts)
    note = f"; {unconfirmed} win(s) not confirmed, kept out (tune confirms every point)" if unconfirmed else ""
    count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
    fused = ", ".join(n_or_never(e.crossover_n) for e in entries)
    return f"dispatch table {path}: {result.op}: {count}, fuse from N = {fused}{note}"


def _n_verdict(point: PointResult) -> NVerdict:
    best = point.best_strategy
    if not point.timings:
        verdict = "failed"
    elif point.disturbed:
        verdict = "disturbed"
    elif point.unstable:
        verdict = "unstable"
    elif point.fused_wins:
        verdict = "fuse" if point.confirmation is not None else "unconfirmed"
    elif point.winner in (MARGINAL, OPEN):
        verdict = point.winner
    else:
        verdict = "same" if point.winner == NO_DIFFERENCE else "loop"
    if best is None:
        return NVerdict(point.n, verdict)
    return NVerdict(point.n, verdict, best, point.speedups.get(best), point.speedup_ci.get(best))


def entries_of(result: BenchmarkResult) -> List[DispatchEntry]:
    """A result's dispatch entries, one per parameter group and dtype; points skipped by the
    memory budget are left out (they were not measured)."""
    if not isinstance(result, BenchmarkResult):
        raise WideTesseraError(f"entries_of: give one BenchmarkResult, got {type(result).__name__}")
    run = result.runs[-1] if result.runs else None
    measured_at = (run.finished or run.started) if run is not None else now()
    entries = []
    for points in parameter_groups(result.points):
        params = dict(points[0].params)
        dtype = params.pop("dtype", "float32")
        env = result.environment
        setting = Setting(
            op=result.op,
            device=torch.device(env.device).type,
            device_name=env.device_name,
            dtype=dtype,
            mode=result.mode,
            compile=result.compile,
            cuda_graph=result.timing.cuda_graph,
            params=params,
        )
        versions: Dict[str, Optional[str]] = dict(run.versions) if run is not None else {"torch": env.torch_version}
        verdicts = [_n_verdict(p) for p in points]
        entry = measured_entry(setting, verdicts, measured_at, versions, env.threads, result.preset, result.run_id)
        entries.append(entry)
    return entries


def measured_entry(
    setting: Setting,
    verdicts: List[NVerdict],
    measured_at: str,
    versions: Dict[str, Optional[str]],
    threads: int,
    preset: str,
    run_id: Optional[str] = None,
) -> DispatchEntry:
    """The entry of `setting` measured with these verdicts, its crossover following from them:
    a benchmark's group of points, or a first call's one N."""
    shared = {f.name: getattr(setting, f.name) for f in fields(Setting)}
    return DispatchEntry(
        **shared,
        verdicts=verdicts,
        crossover_n=_crossover(verdicts),
        measured_at=measured_at,
        versions=versions,
        threads=threads,
        preset=preset,
        run_id=run_id,
    )


@dataclass(frozen=True)
class Case(Setting):
    """What a module asks the table about: an op on a device, in a dtype and mode, with the
    parameters its modules fix and the caller's hints (`params`), at N copies."""

    n: int


@dataclass(frozen=True)
class Match:
    """The table's answer for a case.

    entries: the nearest entries (several when tied; then all must say fuse); distance: theirs;
    fuse, strategy: the decision; measured_n: the measured N that decided; notes: every caveat.
    """

    fuse: bool
    strategy: Optional[str]
    entries: Tuple[DispatchEntry, ...]
    distance: Optional[float]
    measured_n: Optional[int]
    reason: str
    notes: Tuple[str, ...] = ()


def _axis_distance(given: Any, measured: Any) -> Optional[float]:
    """How far a measured axis value is from the case's; None when they cannot be compared.

    Sizes: |ln(a/b)|. A number that may be zero (a routing skew): |ln((1+a)/(1+b))|. Anything
    else (a flag, a name) must be equal.
    """
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (given, measured))
    if not numbers:
        return 0.0 if given == measured else None
    if given > 0 and measured > 0:
        return abs(math.log(given / measured))
    if given >= 0 and measured >= 0:
        return abs(math.log((1 + given) / (1 + measured)))
    return 0.0 if given == measured else None


def _distance(case: Case, entry: DispatchEntry) -> Optional[float]:
    """The sum of the axis distances over the axes the case gives; None when an axis cannot be
    compared or is further than MAX_RATIO. Axes the case does not give match any value."""
    total = 0.0
    for axis, given in case.params.items():
        if axis not in entry.params:
            return None
        d = _axis_distance(given, entry.params[axis])
        if d is None or d > math.log(MAX_RATIO) + 1e-9:
            return None
        total += d
    return total


def _setting_key(x: Setting) -> Tuple[Any, ...]:
    """What must be equal for an entry to decide a case: everything but the parameters."""
    return (x.op, x.device, x.device_name, x.dtype, x.mode, x.compile, x.cuda_graph)


class _AtN(NamedTuple):
    """What one entry says for N copies: fuse or not, with which strategy, the measured N that decides, and why."""

    fuse: bool
    strategy: Optional[str]
    measured_n: Optional[int]
    reason: str


def _at_n(entry: DispatchEntry, n: int) -> _AtN:
    """What `entry` says for N copies, by the conservative rule: fuse only where the largest
    measured N at or below N, and every larger measured N, fused."""
    below = [v for v in entry.verdicts if v.n <= n]
    if not below:
        return _AtN(False, None, None, f"N={n} is below the smallest measured N ({entry.verdicts[0].n})")
    decider = below[-1]
    later = [v for v in entry.verdicts if v.n > decider.n]
    if decider.verdict != "fuse":
        return _AtN(False, None, decider.n, f"at measured N={decider.n} the verdict was {decider.verdict!r}")
    losing = [v for v in later if v.verdict != "fuse"]
    if losing:
        where = ", ".join(f"N={v.n} {v.verdict!r}" for v in losing)
        return _AtN(False, None, decider.n, f"fusing won at measured N={decider.n} but not at every larger N ({where})")
    ci = "" if decider.speedup_ci is None else f" [{decider.speedup_ci[0]:.2f}, {decider.speedup_ci[1]:.2f}]"
    speed = f" {decider.speedup:.2f}x{ci}" if decider.speedup is not None else ""
    how = "measured on a first call" if entry.preset == FIRST_CALL else "confirmed"
    reason = f"{decider.strategy} won at measured N={decider.n}{speed}, {how}, and at every larger measured N"
    return _AtN(True, decider.strategy, decider.n, reason)


def match(table: DispatchTable, case: Case) -> Match:
    """The decision for `case`, by the rule the README writes down:

    1. entries of the case's op on the same device name, in the same dtype, mode, compile
       mode and timing (CUDA graphs or not); others are ignored (a note says so);
    2. among them the nearest by parameters (`_distance`); an axis further than MAX_RATIO,
       or a flag or name that differs, rules an entry out; tied entries must all say fuse;
    3. at N, the conservative rule of `_at_n`.
    No entry left: do not fuse.
    """
    same_op = [e for e in table.entries if e.op == case.op]
    here = [e for e in same_op if (e.device, e.device_name) == (case.device, case.device_name)]
    notes = []
    if same_op and not here:
        others = sorted({e.device_name for e in same_op})
        notes.append(
            f"the table's {case.op} entries were measured on {', '.join(others)}, not {case.device_name}: ignored"
        )
    setting = [e for e in here if _setting_key(e) == _setting_key(case)]
    if here and not setting:
        notes.append(
            f"no {case.op} entry in dtype={case.dtype} mode={case.mode} compile={case.compile} "
            f"cuda_graph={case.cuda_graph} on this device"
        )
    scored = [(d, e) for e in setting for d in [_distance(case, e)] if d is not None]
    if setting and not scored:
        notes.append(
            f"no {case.op} entry comparable with {params_text(case.params) or 'its parameters'} (a flag differs, or a "
            "size is more than "
            f"{MAX_RATIO:g}x away)"
        )
    if not scored:
        return Match(False, None, (), None, None, "no measured entry matches: not fused", tuple(notes))
    best = min(d for d, _ in scored)
    nearest = tuple(e for d, e in scored if d <= best + 1e-9)
    decisions = [_at_n(e, case.n) for e in nearest]
    strategies = sorted({d.strategy for d in decisions if d.fuse and d.strategy is not None})
    fuse = all(d.fuse for d in decisions) and len(strategies) == 1
    reasons = [d.reason for d in decisions]
    given = set(case.params)
    loose = sorted({a for e in nearest for a in e.params if a not in given})
    if len(nearest) > 1:
        # each tied entry's reason, labelled by the values that tell them apart
        apart = [a for a in loose if len({json.dumps(e.params.get(a)) for e in nearest}) > 1]
        reasons = [f"{params_text({a: e.params.get(a) for a in apart})}: {r}" for e, r in zip(nearest, reasons)]
        notes.append(f"{len(nearest)} entries are equally near; fusing needs all of them to fuse, with one strategy")
        if all(d.fuse for d in decisions) and len(strategies) > 1:
            reasons.append(
                f"they won with different strategies ({', '.join(strategies)}): give {', '.join(apart)} to choose"
            )
    if loose:
        notes.append(f"not given, so any measured value matched: {', '.join(loose)}")
    if case.n > nearest[0].verdicts[-1].n:
        notes.append(f"N={case.n} is above the largest measured N ({nearest[0].verdicts[-1].n}); decided by it")
    strategy = strategies[0] if fuse else None
    reason = "; ".join(reasons)
    return Match(fuse, strategy, nearest, best, decisions[0].measured_n, reason, tuple(notes))


def decide(
    table: DispatchTable, case: Case, strategies: Sequence[str], needs: Dict[str, Needs], device: str
) -> Match:
    """The decision for `case` on `device` (pure: the table and the case in, the answer out):
    `match`'s, then what this process can run. A strategy the op does not have (`strategies`:
    a table edited by hand, or measured with a strategy since removed) does not fuse; nor does
    one measured where its needs were met (triton installed then, say) that cannot run here now.
    On a CPU a note names the thread counts measured where they differ from this process's
    (entries are not matched on them, but threads move crossovers)."""
    answer = match(table, case)
    if answer.fuse and answer.strategy not in strategies:
        known = ", ".join(strategies)
        reason = f"{answer.reason}; but {case.op} has no strategy {answer.strategy!r} (its strategies: {known})"
        answer = replace(answer, fuse=False, strategy=None, reason=reason)
    if answer.fuse and answer.strategy is not None:
        dtype = getattr(torch, case.dtype)
        unmet = unmet_need(needs.get(answer.strategy), device, dtype, {**case.params, "dtype": case.dtype})
        if unmet:
            reason = f"{answer.reason}; but {answer.strategy} {unmet}"
            answer = replace(answer, fuse=False, strategy=None, reason=reason)
    here = torch.get_num_threads()
    threads = sorted({e.threads for e in answer.entries if e.threads != here})
    if case.device == "cpu" and threads:
        note = f"measured with {', '.join(map(str, threads))} torch thread(s); this process uses {here}"
        answer = replace(answer, notes=(*answer.notes, note))
    return answer
