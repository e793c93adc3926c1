"""Results: one point, one parameter group, one op's whole run; saved and loaded as JSON."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from dataclasses_json import dataclass_json

from ..errors import WideTesseraError
from . import analysis
from .correctness import Check
from .environment import Environment
from .files import not_a_regular_file, write_atomic
from .result_checks import check_result
from .stats import TimingStats
from .timing import TimingConfig
from .typed_json import check_json

__all__ = [
    "Failure",
    "PointResult",
    "GroupResult",
    "BenchmarkResult",
    "save_results",
    "load_results",
    "params_text",
    "SCHEMA_VERSION",
]

SCHEMA_VERSION = 2


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


@dataclass_json
@dataclass
class PointResult:
    """One N at one parameter combination.

    timings: strategy -> median ms per call ('baseline' included; incorrect strategies are not timed)
    speedups: strategy -> baseline median / strategy median
    speedup_ci: strategy -> [low, high], its 95% confidence interval
    verdicts: strategy -> 'faster', 'slower' or 'same' (no significant difference)
    correct: strategy -> passed the correctness check (False also when it failed to run)
    best_strategy, best_speedup: see `wide_tessera.bench.analysis` (None if no strategy is correct)
    peak_memory_bytes: strategy -> most tensor memory one call held above what was held before
    failures: strategy (or 'point' for the whole point) -> why it has no result
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

    @classmethod
    def from_measurements(
        cls,
        n: int,
        params: Dict[str, Any],
        stats: Dict[str, TimingStats],
        checks: Dict[str, Check],
        seed: int = 0,
        peak_memory_bytes: Optional[Dict[str, int]] = None,
        failures: Optional[Dict[str, Failure]] = None,
    ) -> "PointResult":
        failures = dict(failures or {})
        if "baseline" not in stats:
            return cls.failed(n, params, failures, checks, peak_memory_bytes)
        base = stats["baseline"]
        timings = {s: st.median_ms for s, st in stats.items()}
        speedups = {s: base.median_ms / st.median_ms for s, st in stats.items() if s != "baseline"}
        cis = {s: list(analysis.speedup_ci(base.samples_ms, stats[s].samples_ms, seed)) for s in speedups}
        verdicts = {s: analysis.verdict(ci) for s, ci in cis.items()}
        correct = _correctness(checks, failures)
        best = analysis.pick_best(speedups, verdicts, correct)
        best_speedup = None if best is None else speedups[best]
        return cls(
            n,
            params,
            timings,
            speedups,
            cis,
            verdicts,
            correct,
            best,
            best_speedup,
            checks,
            stats,
            dict(peak_memory_bytes or {}),
            failures,
        )

    @classmethod
    def failed(
        cls,
        n: int,
        params: Dict[str, Any],
        failures: Dict[str, Failure],
        checks: Optional[Dict[str, Check]] = None,
        peak_memory_bytes: Optional[Dict[str, int]] = None,
    ) -> "PointResult":
        """A point with no timings: its setup or its baseline failed, or it was skipped."""
        checks = dict(checks or {})
        correct = _correctness(checks, failures)
        return cls(n, params, {}, {}, {}, {}, correct, None, None, checks, {}, dict(peak_memory_bytes or {}), failures)

    @property
    def fused_wins(self) -> bool:
        """A correct strategy is significantly faster than the N separate calls."""
        return self.best_strategy is not None and self.verdicts[self.best_strategy] == "faster"

    @property
    def winner(self) -> str:
        """The winning strategy; 'baseline' when fusing loses, 'no_difference' when it is a statistical tie."""
        if self.fused_wins:
            return self.best_strategy
        if self.best_strategy is not None and self.verdicts[self.best_strategy] == "same":
            return "no_difference"
        return "baseline"


def _correctness(checks: Dict[str, Check], failures: Dict[str, Failure]) -> Dict[str, bool]:
    """Strategy -> correct; a strategy that failed to run is not correct."""
    correct = {s: c.correct for s, c in checks.items()}
    correct.update({s: False for s in failures if s != "point"})
    return correct


@dataclass_json
@dataclass
class GroupResult:
    """All points that share their parameters and differ in N, and where fusing starts to pay."""

    params: Dict[str, Any]
    n_values: List[int]
    crossover_n: Optional[int]


@dataclass_json
@dataclass
class BenchmarkResult:
    """One op's benchmark. The crossover and threshold rules are in `wide_tessera.bench.analysis`."""

    op: str
    preset: str
    strategies: List[str]
    environment: Environment
    timer: str
    timing: TimingConfig
    seed: int
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
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_points(cls, points: List[PointResult], **run_info: Any) -> "BenchmarkResult":
        groups: Dict[str, List[PointResult]] = {}
        for p in points:
            if "point" in p.failures and p.failures["point"].kind == "skipped":
                continue  # a skipped point says nothing about where fusing starts to pay
            groups.setdefault(json.dumps(p.params, sort_keys=True), []).append(p)
        group_results = [
            GroupResult(
                params=ps[0].params,
                n_values=[p.n for p in ps],
                crossover_n=analysis.group_crossover([(p.n, p.fused_wins) for p in ps]),
            )
            for ps in groups.values()
        ]
        crossovers = [g.crossover_n for g in group_results]
        speedups = [p.best_speedup for p in points if p.best_speedup is not None]
        return cls(
            points=points,
            groups=group_results,
            crossover_n=analysis.overall_crossover(crossovers),
            recommended_threshold=analysis.recommended_threshold(crossovers),
            strategy_wins=dict(Counter(p.winner for p in points)),
            best_speedup=max(speedups) if speedups else None,
            **run_info,
        )

    @property
    def device(self) -> str:
        return self.environment.device

    @property
    def failures(self) -> List[str]:
        """One line per incorrect, failed, timed-out or crashed strategy or point, with the reason."""
        lines = []
        for p in self.points:
            where = f"N={p.n} {params_text(p.params)}"
            lines += [f"{where} {s}: incorrect: {c.error}" for s, c in p.checks.items() if not c.correct]
            lines += [f"{where} {s}: {f}" for s, f in p.failures.items() if f.kind != "skipped"]
        return lines

    @property
    def skipped(self) -> List[str]:
        return [
            f"N={p.n} {params_text(p.params)}: {f.message}"
            for p in self.points
            for f in p.failures.values()
            if f.kind == "skipped"
        ]

    @property
    def warnings(self) -> List[str]:
        """One line per timing that was noisy or did not converge."""
        return [
            f"N={p.n} {params_text(p.params)} {s}: {'; '.join(st.warnings)}"
            for p in self.points
            for s, st in p.stats.items()
            if st.warnings
        ]

    @property
    def all_correct(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        from .report import format_summary

        return format_summary(self)

    def save(self, path: Union[str, Path]) -> None:
        save_results([self], path)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "BenchmarkResult":
        results = load_results(path)
        if len(results) != 1:
            raise WideTesseraError(f"{path}: holds {len(results)} results; read it with wide_tessera.load_results")
        return results[0]


def params_text(params: Dict[str, Any]) -> str:
    """'batch=8 channels=64 dtype=float32': how summaries and progress lines name a point's parameters."""
    return " ".join(f"{k}={v}" for k, v in params.items())


def save_results(results: Sequence[BenchmarkResult], path: Union[str, Path]) -> None:
    """Write results to one JSON file (the format `load_results` reads).

    Replaced atomically (see `files.write_atomic`); a symlink is written through to its
    target; anything else that is not a regular file is refused.
    """
    if not isinstance(results, (list, tuple)) or not all(isinstance(r, BenchmarkResult) for r in results):
        raise WideTesseraError(
            f"save_results: give a list of BenchmarkResult, got {type(results).__name__} "
            "(one result: result.save(path))"
        )
    doc = {"schema_version": SCHEMA_VERSION, "results": [r.to_dict() for r in results]}
    write_atomic(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a results file holds")


def load_results(path: Union[str, Path]) -> List[BenchmarkResult]:
    """Read every result from a file written by `save_results`, `result.save` or `wide_tessera benchmark -o`.

    Every field is checked (types, then what must hold between them), so a damaged or
    foreign file gives one line naming the file and the first problem, never a traceback.
    """
    kind = not_a_regular_file(Path(path))
    if kind is not None:  # reading a FIFO would wait forever
        raise WideTesseraError(f"{path}: is {kind}, not a results file")
    try:
        doc = json.loads(Path(path).read_text(), parse_constant=_reject_constant)
        if not isinstance(doc, dict) or "schema_version" not in doc:
            raise WideTesseraError("no schema_version")
        version = doc["schema_version"]
        if version != SCHEMA_VERSION:
            raise WideTesseraError(f"schema version {version!r}; this wide_tessera reads {SCHEMA_VERSION}")
        check_json(doc.get("results"), List[Dict[str, Any]], "results")
        results = []
        for i, raw in enumerate(doc["results"]):
            check_json(raw, BenchmarkResult, f"results[{i}]")
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # dataclasses-json warns about what it cannot decode
                result = BenchmarkResult.from_dict(raw)
            check_result(result, f"results[{i}]")
            results.append(result)
        return results
    except OSError as e:
        raise WideTesseraError(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001  RecursionError from deep nesting included: bad file, one line
        detail = str(e) if isinstance(e, WideTesseraError) else f"{type(e).__name__}: {e}"
        raise WideTesseraError(f"{path}: not a wide_tessera results file ({' '.join(detail.split())})") from None
