"""Results as data: one point, one parameter group, one op's whole run, and how they are written as JSON.

Reading a file back, with every invariant checked, is `results.load`, which this module does not
import; drawing a result is `wide_tessera.reports`, reached only by the thin calls at the end of
`BenchmarkResult` (result.summary(), .warnings, ...), which the import contracts declare.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from dataclasses_json import dataclass_json

if TYPE_CHECKING:
    import pandas

from ..core.correctness import Check
from ..core.environment import Environment
from ..core.errors import WideTesseraError
from ..core.files import RESULTS, write_atomic
from ..core.job import Work
from ..core.jsonio import json_text
from ..core.roles import BASELINE
from ..core.stats import TimingStats
from ..measurement.energy import Energy
from ..measurement.health import Health, RunHealth
from ..measurement.roofline import Peaks
from ..measurement.settings import RunSettings
from ..measurement.timing import TimingConfig
from .decisions import Decision
from .manifest import Manifest

__all__ = [
    "Failure",
    "Where",
    "PointResult",
    "GroupResult",
    "BenchmarkResult",
    "save_results",
    "ResultsFile",
    "Confirmation",
    "SCHEMA_VERSION",
]

# 3: health, confirmation, reliability, the stored winner, per-model errors, significant-only best speedups.
# 4: run manifests. A version-3 file reads as a result without manifests.
# 5: the mode (inference or a training mode).
# 6: energy per call (--energy). A version-5 file reads as points without it.
# 7: the run's settings as one object (measurement.settings.RunSettings), where 3 to 6 held
#    preset, timing, seed, confirm, compile and mode as fields of their own (results.load moves them).
SCHEMA_VERSION = 7
READABLE_VERSIONS = (3, 4, 5, 6, 7)


@dataclass_json
@dataclass(frozen=True)
class Failure:
    """Why a strategy, or a whole point, has no result.

    kind: 'error' (it raised), 'timeout' (a stage overran its limit), 'crash' (the
    isolated worker died), or 'skipped' (the memory budget ruled it out; not a failure
    of the code, so it does not fail the run).
    """

    stage: str
    kind: str
    error_type: str
    message: str
    elapsed_s: Optional[float] = None
    limit_s: Optional[float] = None

    def __str__(self) -> str:
        limit = "" if self.limit_s is None else f" after {self.elapsed_s:.1f} s (limit {self.limit_s:.1f} s)"
        return f"{self.kind} in {self.stage}{limit}: {self.error_type}: {self.message}"


# A point's `winner` where it is no strategy: the N separate calls, a statistical tie with them,
# a gain about the margin, undecided at the budget, passes that contradict each other, a
# measurement that could not be cleaned; a confirmation's may also be a pass that failed.
NO_DIFFERENCE, MARGINAL, OPEN, UNSTABLE, DISTURBED, FAILED = (
    "no_difference",
    "marginal",
    "open",
    "unstable",
    "disturbed",
    "failed",
)
NON_STRATEGY_WINNERS = (BASELINE, NO_DIFFERENCE, MARGINAL, OPEN, UNSTABLE, DISTURBED)
CONFIRMATION_WINNERS = (*NON_STRATEGY_WINNERS, FAILED)


@dataclass_json
@dataclass(frozen=True)
class Confirmation:
    """The confirmation pass's measurement of a point: later in the run, on models and inputs built
    afresh from a seed of its own.

    agrees: its decision on fusing does not contradict the point's (results.decisions.compatible:
    a win against a loop does; a marginal or open pass contradicts nothing). When it does, the
    point is unstable. replaced: this is the first pass, which the confirmation outranked (it
    was disturbed, or still open, and the confirmation was neither), so the point holds the
    confirmation's measurement and this one is kept for the record.
    """

    timings: Dict[str, float]
    speedups: Dict[str, float]
    speedup_ci: Dict[str, List[float]]
    verdicts: Dict[str, str]
    winner: str
    agrees: bool
    health: Optional[Health] = None
    decision: Optional[Decision] = None
    replaced: bool = False


@dataclass_json
@dataclass(frozen=True)
class Where:
    """Which process measured a point of a sharded run (torchrun): its rank, host and device."""

    rank: int
    host: str
    device: str


@dataclass_json
@dataclass(kw_only=True)  # 24 fields: a value given by position would shift silently when one is added
class PointResult:
    """One N at one parameter combination; `wide_tessera.results.analysis` computes it from measurements.

    timings: strategy -> median ms per call ('baseline' included; incorrect strategies are not timed)
    speedups: strategy -> how many times faster than the baseline: the median of the paired
        rounds' ratios (files before decisions: baseline median / strategy median)
    speedup_ci: strategy -> [low, high], its confidence interval at `decision.level` (99.4% per
        look, 95% over all looks; see results.decisions), 95% in files before decisions
    verdicts: strategy -> 'faster', 'slower' or 'same' (no significant difference)
    correct: strategy -> passed the correctness check (False also when it failed to run)
    best_strategy: the fastest correct significantly-faster strategy, else the correct one with
        the highest speedup (None if none is correct)
    best_speedup: its speedup when it is significantly faster, else None: never a headline from noise
    winner: best_strategy when fusing wins, 'marginal' when it gains about the margin,
        'no_difference' on a statistical tie, 'open' when undecided, else 'baseline';
        'unstable' when the confirmation pass disagreed, 'disturbed' when the measurement could not
        be cleaned of disturbance
    decision: what the point decided (results.decisions.Decision), how many rounds it took and
        when it settled; None in files from before decisions
    traces: the profiler traces written of its callables (--trace)
    peak_memory_bytes: strategy -> most tensor memory one call held above what was held before
    failures: strategy (or 'point' for the whole point) -> why it has no result
    health: what the machine did while the point was timed
    confirmation: the second, independent measurement, where one was taken
    flags: reasons to take a second look (an implausibly large speedup, a strategy that did not fuse)
    first_call_s: callable -> seconds of its first call, one-time work included: torch.compile's
        compilation, Triton's JIT and autotuning, library handles. It is kept out of the
        timings and the memory peaks, which are steady-state.
    launches: callable -> device kernels launched per call (CUDA) or top-level ATen operators
        dispatched per call (CPU), from the profiler (measurement.launches)
    work: what one call of the N models must do (flops, fewest bytes), where the op declares it
    energy: callable -> its energy per call and power from NVML's counter (measurement.energy), where
        the run was asked for it
    where: the rank, host and device that measured it, in a sharded run (torchrun); None otherwise
    """

    n: int
    params: Dict[str, Any]
    timings: Dict[str, float]
    speedups: Dict[str, float]
    speedup_ci: Dict[str, List[float]]
    verdicts: Dict[str, str]
    correct: Dict[str, bool]
    best_strategy: Optional[str]
    best_speedup: Optional[float]
    checks: Dict[str, Check]
    stats: Dict[str, TimingStats]
    peak_memory_bytes: Dict[str, int] = field(default_factory=dict)
    failures: Dict[str, Failure] = field(default_factory=dict)
    winner: str = BASELINE
    health: Optional[Health] = None
    confirmation: Optional[Confirmation] = None
    flags: List[str] = field(default_factory=list)
    first_call_s: Dict[str, float] = field(default_factory=dict)
    launches: Dict[str, float] = field(default_factory=dict)
    work: Optional[Work] = None
    energy: Dict[str, Energy] = field(default_factory=dict)
    where: Optional[Where] = None
    decision: Optional[Decision] = None
    traces: List[str] = field(default_factory=list)

    @property
    def unstable(self) -> bool:
        """The confirmation pass came to another verdict: neither verdict is trusted."""
        return self.confirmation is not None and not self.confirmation.agrees

    @property
    def disturbed(self) -> bool:
        """Too few rounds escaped disturbance (a busy machine, throttling): no verdict is drawn."""
        return self.health is not None and not self.health.cleaned

    @property
    def fused_wins(self) -> bool:
        """The point decided to fuse (results.decisions: within ε of the margin or beyond it; in
        files from before regret bounds, a correct strategy significantly faster than the margin),
        in a measurement that was not disturbed and that a confirmation did not contradict."""
        if self.unstable or self.disturbed:
            return False
        if self.decision is not None and self.decision.epsilon is not None:
            return self.decision.kind == "fuse"
        return self.best_strategy is not None and self.verdicts[self.best_strategy] == "faster"


@dataclass_json
@dataclass(frozen=True)
class FuseOrCapture:
    """At a group's largest N: the fastest correct strategy against the fastest control.

    speedup: how many times faster the strategy is than the control (the median of the paired
    rounds' ratios), with its interval at the point's level, and the verdict by the same rule as
    every speedup: 'faster' means fusing beats capturing. answer: 'fuse' (known to gain more than
    the margin over capturing), 'capture' (known not to), 'either' (it gains about the margin)
    or 'open' (results.decisions.decide_capture);
    empty in files from before decisions.
    """

    n: int
    strategy: str
    control: str
    speedup: float
    ci: List[float]
    verdict: str
    answer: str = ""


@dataclass_json
@dataclass
class GroupResult:
    """All points that share their parameters and differ in N, and where fusing starts to pay.

    crossover_n: the smallest N from which fusing wins at every larger N (None: never).
    marginal_n: the Ns where fusing gains about the margin, either choice costing little; a
    crossover reads "fuse from N=8; N=4 marginal". problems: why a decision of the group could
    flip (results.reliability); empty when none can. notes: what was seen that cannot flip one
    (a busy machine, a disturbed point that decides nothing). fuse_or_capture: the best
    strategy against the best control at the largest N, where both ran. undecided_n: the Ns
    the crossover rests on whose decision is not known (disturbed and never measured clean,
    unstable, or open: at the budget, or over passes that disagree); with the largest N among
    them, "never" is not known. falls_n: the Ns where the loop was decided above an N that
    fuses: the speedup falls as N grows there, which a crossover assumes it does not; the
    crossover is read above the last of them (results.analysis.falls).
    """

    params: Dict[str, Any]
    n_values: List[int]
    crossover_n: Optional[int]
    problems: List[str] = field(default_factory=list)
    fuse_or_capture: Optional[FuseOrCapture] = None
    marginal_n: List[int] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    undecided_n: List[int] = field(default_factory=list)
    falls_n: List[int] = field(default_factory=list)


@dataclass_json
@dataclass
class BenchmarkResult:
    """One op's benchmark. `wide_tessera.results.analysis` computes it; the rules are written there.

    settings: how the points were measured (measurement.settings.RunSettings: preset, seed, mode,
    compile mode, timing, confirmation...). reliable / unreliable_reasons: the verdict on the run
    itself. health: the machine over the whole run. peaks: the device's
    measured ceilings (measurement.roofline), where the run was asked for the roofline. runs: the
    manifest of every run that measured points of this result (a `--resume` adds one); the
    first one's `run_id` is the result's.
    """

    op: str
    strategies: List[str]
    environment: Environment
    timer: str
    settings: RunSettings
    duration_s: float
    points: List[PointResult]
    groups: List[GroupResult]
    crossover_n: Optional[int]
    recommended_threshold: Optional[int]
    strategy_wins: Dict[str, int]
    best_speedup: Optional[float]
    memory_method: str = ""
    # False when the run stopped early (Ctrl-C, a killed process): `--resume` completes it.
    complete: bool = True
    reliable: bool = True
    unreliable_reasons: List[str] = field(default_factory=list)
    health: Optional[RunHealth] = None
    peaks: Optional[Peaks] = None
    runs: List[Manifest] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    @property
    def run_id(self) -> Optional[str]:
        """The id of the run that started this result; None for a file from before manifests."""
        return self.runs[0].run_id if self.runs else None

    @property
    def device(self) -> str:
        return self.environment.device

    # The settings a result is most often asked for, by name (they live in `settings`).
    @property
    def preset(self) -> str:
        return self.settings.preset or ""

    @property
    def timing(self) -> TimingConfig:
        assert self.settings.timing is not None  # RunSettings.__post_init__ fills it
        return self.settings.timing

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def confirm(self) -> str:
        assert self.settings.confirm is not None  # RunSettings.__post_init__ fills it
        return self.settings.confirm

    @property
    def compile(self) -> str:
        return self.settings.compile

    @property
    def mode(self) -> str:
        return self.settings.mode

    # What a result is shown as: thin calls to plain functions of `reports`. The data imports its
    # renderers only here, inside these calls, and the layer contract declares exactly these
    # imports (setup.cfg): reading a result needs no renderer, and a renderer needs the data.

    @property
    def failures(self) -> List[str]:
        """One line per incorrect, failed, timed-out or crashed strategy or point, with the reason."""
        from ..reports.text import failure_lines

        return failure_lines(self)

    @property
    def skipped(self) -> List[str]:
        """One line per strategy or point skipped (a need unmet here, the memory budget), with the reason."""
        from ..reports.text import skipped_lines

        return skipped_lines(self)

    @property
    def warnings(self) -> List[str]:
        """Every warning, one line each: noisy or unconverged timings, disturbed measurements,
        unstable points, strategies that did not fuse, implausible speedups."""
        from ..reports.text import warning_lines

        return warning_lines(self)

    @property
    def all_correct(self) -> bool:
        """No strategy was incorrect, and nothing failed (a skip is not a failure)."""
        return all(
            all(c.correct for c in p.checks.values()) and all(f.kind == "skipped" for f in p.failures.values())
            for p in self.points
        )

    @property
    def measured_energy(self) -> bool:
        """Whether the run was asked for energy (--energy)."""
        return self.settings.energy

    def summary(self) -> str:
        """The full text summary (reports.text): every timing, memory, launches, decisions."""
        from ..reports.text import format_summary

        return format_summary(self)

    def brief(self) -> str:
        """The answer in a table that fits a terminal (reports.brief): what a run prints."""
        from ..reports.brief import brief_summary

        return brief_summary(self)

    def _repr_html_(self) -> str:
        """What a notebook cell shows: the answer table and the plots (reports.notebook)."""
        from ..reports.notebook import result_html

        return result_html(self)

    def _repr_markdown_(self) -> str:
        from ..reports.markdown import result_markdown

        return result_markdown(self)

    def to_rows(self) -> List[Dict[str, Any]]:
        """The tidy rows: one dict per (N, parameters, strategy); see `reports.tidy`."""
        from ..reports.tidy import rows

        return rows([self])

    def to_dataframe(self) -> "pandas.DataFrame":
        """The tidy rows as a pandas DataFrame (the `pandas` extra); many results: `wide_tessera.to_dataframe`."""
        from ..reports.tidy import to_dataframe

        return to_dataframe([self])

    def save(self, path: Union[str, Path]) -> None:
        """Write this result alone to `path` (see save_results); `wide_tessera.load_results` reads it."""
        save_results([self], path)


def save_results(results: Sequence[BenchmarkResult], path: Union[str, Path]) -> None:
    """Write results to one JSON file (the format `load_results` reads).

    Replaced atomically (see `files.write_atomic`); a symlink is written through to its
    target; anything else that is not a regular file is refused.
    """
    ResultsFile(path).write(results)


class ResultsFile:
    """A results file that a run writes again and again (after every point it measures): each
    result is encoded once, not at every write. Encoding every result at every write grew with
    the square of the points: in the quick preset of all ops it was the last 0.24 s of 197 writes
    (about 24 s of a 146 s run; 2-core CPU, 2026-11-27). Each point, too, is encoded once: the
    op being measured changes at every write, and encoding all its points again (dataclasses_json's
    to_dict, 34 ms for a result of a dozen points) cost 6.7 s of the next quick run of all ops
    (profiled, 2026-11-27). A result or a point is taken as unchanged while it is the same object:
    the run replaces them, it never changes one in place."""

    def __init__(self, path: Union[str, Path]):
        self.path = path
        self.encoded: Dict[int, Tuple[BenchmarkResult, str]] = {}  # id -> (the result, kept alive; its text)
        self.points: Dict[int, Tuple[PointResult, Dict[str, Any]]] = {}  # id -> (the point, kept alive; its dict)

    def write(self, results: Sequence[BenchmarkResult]) -> None:
        if not isinstance(results, (list, tuple)) or not all(isinstance(r, BenchmarkResult) for r in results):
            raise WideTesseraError(
                f"save_results: give a list of BenchmarkResult, got {type(results).__name__} "
                "(one result: result.save(path))"
            )
        self.points = {id(p): (p, self.point(p)) for r in results for p in r.points}
        self.encoded = {id(r): (r, self.text(r)) for r in results}
        body = ",\n".join(self.encoded[id(r)][1] for r in results)
        write_atomic(self.path, f'{{"schema_version": {SCHEMA_VERSION}, "results": [\n{body}\n]}}\n', RESULTS)

    def text(self, result: BenchmarkResult) -> str:
        known = self.encoded.get(id(result))
        if known is not None:
            return known[1]
        document = dataclasses.replace(result, points=[]).to_dict()  # type: ignore[attr-defined]  # dataclass_json adds it
        document["points"] = [self.point(p) for p in result.points]
        return json_text(self.path, document)

    def point(self, point: PointResult) -> Dict[str, Any]:
        known = self.points.get(id(point))
        return known[1] if known is not None else point.to_dict()  # type: ignore[attr-defined]  # dataclass_json adds it
