"""What must hold in a loaded result beyond its field types: one check per dataclass.

A results file can be edited, truncated by hand or written by something else. Without these
checks a negative time loads and shows as `-5`, and a verdict for a strategy with no timing
raises a KeyError in the summary. Each check raises one WideTesseraError line naming where.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Collection, Dict, Iterable, Optional

from ..core.errors import WideTesseraError
from ..core.job import MAX_N
from ..core.roles import BASELINE, CONTROLS, POINT
from ..core.user_input import MAX_SEED
from ..measurement.controls import COMPILE_MODES
from ..measurement.modes import MODES
from .decisions import CAPTURE_KINDS, KINDS
from .schema import CONFIRMATION_WINNERS, NON_STRATEGY_WINNERS

if TYPE_CHECKING:
    from ..core.correctness import Check
    from ..core.stats import TimingStats
    from ..measurement.health import Health
    from .decisions import Decision
    from .schema import BenchmarkResult, Confirmation, Failure, GroupResult, PointResult

__all__ = ["check_result"]

STRATEGY_VERDICTS = ("faster", "slower", "same")
FAILURE_KINDS = ("error", "timeout", "crash", "skipped")


def _need(ok: bool, where: str, problem: str) -> None:
    if not ok:
        raise WideTesseraError(f"{where}: {problem}")


def _non_negative(where: str, value: Optional[float]) -> None:
    _need(value is None or value >= 0, where, f"{value!r} is negative")


def _positive(where: str, value: float) -> None:
    # No timer measures a call in zero time: a zero is a damaged file, and ratios divide by it.
    _need(value > 0, where, f"{value!r} is not positive")


def _positive_int(where: str, value: Optional[int]) -> None:
    _need(value is None or value >= 1, where, f"{value!r} is not a positive integer")


def _keys(where: str, mapping: Dict[str, Any], allowed: Collection[str]) -> None:
    unknown = sorted(set(mapping) - set(allowed))
    _need(not unknown, where, f"unknown name(s) {', '.join(map(repr, unknown))} (valid: {', '.join(allowed)})")


def _same_keys(where: str, mapping: Dict[str, Any], expected: Iterable[str], what: str) -> None:
    _need(set(mapping) == set(expected), where, f"names {sorted(mapping)} differ from {what} {sorted(expected)}")


def _params(where: str, params: Dict[str, Any]) -> None:
    for key, value in params.items():
        _need(value is None or isinstance(value, (str, int, float)), f"{where}[{key!r}]", "is not a single value")


def check_result(r: "BenchmarkResult", where: str) -> None:
    strategies = r.strategies
    _need(bool(r.op), f"{where}.op", "is empty")
    _need(bool(strategies), f"{where}.strategies", "is empty")
    _need(len(set(strategies)) == len(strategies), f"{where}.strategies", f"{strategies} repeats a name")
    _need(all(strategies) and not {BASELINE, POINT} & set(strategies), f"{where}.strategies", f"{strategies}")
    if r.peaks is not None:
        for d, t in r.peaks.tflops.items():
            _need(t > 0, f"{where}.peaks.tflops[{d!r}]", f"{t} is not positive")
        _need(r.peaks.copy_gbps > 0, f"{where}.peaks.copy_gbps", f"{r.peaks.copy_gbps} is not positive")
    _need(r.mode in MODES, f"{where}.mode", f"{r.mode!r} is not one of {', '.join(MODES)}")
    _need(r.compile in COMPILE_MODES, f"{where}.compile", f"{r.compile!r} is not one of {', '.join(COMPILE_MODES)}")
    _need(0 <= r.seed <= MAX_SEED, f"{where}.seed", f"{r.seed} is not in [0, {MAX_SEED}]")
    _need(r.environment.threads >= 1, f"{where}.environment.threads", f"{r.environment.threads} is not positive")
    _non_negative(f"{where}.duration_s", r.duration_s)
    _positive_int(f"{where}.crossover_n", r.crossover_n)
    _positive_int(f"{where}.recommended_threshold", r.recommended_threshold)
    _need(r.best_speedup is None or r.best_speedup > 0, f"{where}.best_speedup", f"{r.best_speedup} is not positive")
    _keys(f"{where}.strategy_wins", r.strategy_wins, [*NON_STRATEGY_WINNERS, *strategies])
    for s, wins in r.strategy_wins.items():
        _non_negative(f"{where}.strategy_wins[{s!r}]", wins)
    for i, p in enumerate(r.points):
        _check_point(p, strategies, f"{where}.points[{i}]")
        # The summary's columns are the first point's axes.
        _need(list(p.params) == list(r.points[0].params), f"{where}.points[{i}].params", "names other axes")
    for i, g in enumerate(r.groups):
        _check_group(g, f"{where}.groups[{i}]")
    for i, m in enumerate(r.runs):
        _positive_int(f"{where}.runs[{i}].cores", m.cores)
        _positive_int(f"{where}.runs[{i}].usable_cores", m.usable_cores)
        _need(0 <= m.seed <= MAX_SEED, f"{where}.runs[{i}].seed", f"{m.seed} is not in [0, {MAX_SEED}]")


def _check_point(p: "PointResult", strategies: Collection[str], where: str) -> None:
    strategies = [*strategies, *CONTROLS]  # a control is timed, checked and reported like a strategy
    timed = [BASELINE, *strategies]
    _positive_int(f"{where}.n", p.n)
    _need(p.n <= MAX_N, f"{where}.n", f"{p.n} is more than {MAX_N}, the most copies this tool builds")
    _params(f"{where}.params", p.params)
    _check_timings(p, timed, where)
    _check_outcomes(p, strategies, timed, where)
    _check_answer(p, where)
    _check_facts(p, timed, where)
    if p.health is not None:
        _check_health(p.health, f"{where}.health")
    if p.confirmation is not None:
        _check_confirmation(p.confirmation, strategies, f"{where}.confirmation")
    if p.decision is not None:
        _check_decision(p.decision, p.speedups, f"{where}.decision")


def _check_timings(p: "PointResult", timed: Collection[str], where: str) -> None:
    """The timings, speedups, their intervals and verdicts, and the samples' statistics: of one
    set of callables, each value in its range."""
    _keys(f"{where}.timings", p.timings, timed)
    expected_timed = {BASELINE, *p.speedups} if p.timings or p.speedups else set()
    _same_keys(f"{where}.timings", p.timings, expected_timed, "baseline and the speedups'")
    _same_keys(f"{where}.speedup_ci", p.speedup_ci, p.speedups, "the speedups'")
    _same_keys(f"{where}.verdicts", p.verdicts, p.speedups, "the speedups'")
    _same_keys(f"{where}.stats", p.stats, p.timings, "the timings'")
    for s, ms in p.timings.items():
        _positive(f"{where}.timings[{s!r}]", ms)
    for s, x in p.speedups.items():
        _need(x > 0, f"{where}.speedups[{s!r}]", f"{x} is not positive")
    for s, ci in p.speedup_ci.items():
        _need(len(ci) == 2 and 0 <= ci[0] <= ci[1], f"{where}.speedup_ci[{s!r}]", f"{ci} is not [low, high]")
    for s, v in p.verdicts.items():
        _need(v in STRATEGY_VERDICTS, f"{where}.verdicts[{s!r}]", f"{v!r} is not one of {', '.join(STRATEGY_VERDICTS)}")
    for s, st in p.stats.items():
        _check_stats(st, f"{where}.stats[{s!r}]")


def _check_outcomes(p: "PointResult", strategies: Collection[str], timed: Collection[str], where: str) -> None:
    """What each callable's checks and runs found: correctness, checks, failures, memory peaks, energy."""
    _keys(f"{where}.correct", p.correct, strategies)
    _keys(f"{where}.checks", p.checks, strategies)
    for s, c in p.checks.items():
        _check_check(c, f"{where}.checks[{s!r}]")
    _keys(f"{where}.failures", p.failures, [*strategies, POINT])
    for s, f in p.failures.items():
        _check_failure(f, f"{where}.failures[{s!r}]")
    _keys(f"{where}.peak_memory_bytes", p.peak_memory_bytes, timed)
    for s, b in p.peak_memory_bytes.items():
        _non_negative(f"{where}.peak_memory_bytes[{s!r}]", b)
    _keys(f"{where}.energy", p.energy, timed)
    for s, e in p.energy.items():
        at = f"{where}.energy[{s!r}]"
        _need(
            0 < e.low_mj <= e.mj_per_call <= e.high_mj,
            at,
            f"{e.low_mj} <= {e.mj_per_call} <= {e.high_mj} does not hold",
        )
        _positive(f"{at}.watts", e.watts)
        _positive_int(f"{at}.windows", e.windows)


def _check_answer(p: "PointResult", where: str) -> None:
    """The point's answer: a baseline or the reason it has none, a best strategy with a speedup,
    a headline only from it, a winner that is not a control."""
    # The summary shows either the baseline's time or why the point has none.
    _need(POINT in p.failures or BASELINE in p.timings, where, "has neither a baseline timing nor a point failure")
    best = p.best_strategy
    _need(best is None or best in p.speedups, f"{where}.best_strategy", f"{best!r} has no speedup")
    # A headline only from a significant speedup: None, or the best strategy's own.
    _need(
        p.best_speedup is None or (best is not None and p.best_speedup == p.speedups[best]),
        f"{where}.best_speedup",
        f"{p.best_speedup} is not the best strategy's speedup",
    )
    _need(
        p.winner in NON_STRATEGY_WINNERS or (p.winner in p.speedups and p.winner not in CONTROLS),
        f"{where}.winner",
        f"{p.winner!r} is not a winner here",
    )
    _need(best not in CONTROLS, f"{where}.best_strategy", f"{best!r} is a control, not a strategy")


def _check_facts(p: "PointResult", timed: Collection[str], where: str) -> None:
    """The first calls' seconds, the launches and the work: none negative."""
    _keys(f"{where}.first_call_s", p.first_call_s, timed)
    for s, seconds in p.first_call_s.items():
        _non_negative(f"{where}.first_call_s[{s!r}]", seconds)
    _keys(f"{where}.launches", p.launches, timed)
    for s, k in p.launches.items():
        _non_negative(f"{where}.launches[{s!r}]", k)
    if p.work is not None:
        _non_negative(f"{where}.work.flops", p.work.flops)
        _non_negative(f"{where}.work.min_bytes", p.work.min_bytes)


def _check_decision(d: "Decision", speedups: Collection[str], where: str) -> None:
    call = d.call
    _need(call.kind in KINDS, f"{where}.call.kind", f"{call.kind!r} is not one of {', '.join(KINDS)}")
    for s in [call.strategy, *call.ties, *call.rivals]:
        _need(s is None or s in speedups, f"{where}.call", f"{s!r} has no speedup")
    _need(call.capture is None or call.capture in CAPTURE_KINDS, f"{where}.call.capture", f"{call.capture!r}")
    _need(0.5 <= d.level < 1, f"{where}.level", f"{d.level} is not a confidence level")
    _positive_int(f"{where}.rounds", d.rounds)
    _need(
        d.settled_at is None or 1 <= d.settled_at <= d.rounds,
        f"{where}.settled_at",
        f"{d.settled_at} is not in [1, rounds]",
    )


def _check_health(h: "Health", where: str) -> None:
    for name in ("rounds", "disturbed_rounds", "other_load_cores", "steal", "cores", "cpu_freq_ratio", "blocked"):
        _non_negative(f"{where}.{name}", getattr(h, name))


def _check_confirmation(c: "Confirmation", strategies: Collection[str], where: str) -> None:
    _keys(f"{where}.timings", c.timings, [BASELINE, *strategies])
    for s, ms in c.timings.items():  # a comparison of runs divides by them
        _positive(f"{where}.timings[{s!r}]", ms)
    _same_keys(f"{where}.speedup_ci", c.speedup_ci, c.speedups, "the speedups'")
    _same_keys(f"{where}.verdicts", c.verdicts, c.speedups, "the speedups'")
    for s, v in c.verdicts.items():
        _need(v in STRATEGY_VERDICTS, f"{where}.verdicts[{s!r}]", f"{v!r} is not one of {', '.join(STRATEGY_VERDICTS)}")
    _need(c.winner in (*CONFIRMATION_WINNERS, *strategies), f"{where}.winner", f"{c.winner!r} is not a winner")
    if c.health is not None:
        _check_health(c.health, f"{where}.health")


def _check_stats(st: "TimingStats", where: str) -> None:
    _positive_int(f"{where}.calls_per_sample", st.calls_per_sample)
    _need(st.n_samples == len(st.samples_ms) >= 1, f"{where}.n_samples", f"{st.n_samples} samples listed")
    _need(len(st.median_ci_ms) == 2, f"{where}.median_ci_ms", f"{st.median_ci_ms} is not [low, high]")
    times = {name: getattr(st, name) for name in ("median_ms", "mean_ms", "std_ms", "min_ms", "max_ms", "iqr_ms")}
    times.update({name: getattr(st, name) for name in ("p10_ms", "p90_ms", "p99_ms", "cv", "outliers")})
    times.update({f"samples_ms[{i}]": x for i, x in enumerate(st.samples_ms)})
    times.update({f"median_ci_ms[{i}]": x for i, x in enumerate(st.median_ci_ms)})
    for name, value in times.items():
        _non_negative(f"{where}.{name}", value)


def _check_check(c: "Check", where: str) -> None:
    _need(c.tolerance > 0, f"{where}.tolerance", f"{c.tolerance} is not positive")
    _non_negative(f"{where}.max_rel_error", c.max_rel_error)


def _check_failure(f: "Failure", where: str) -> None:
    _need(f.kind in FAILURE_KINDS, f"{where}.kind", f"{f.kind!r} is not one of {', '.join(FAILURE_KINDS)}")
    _non_negative(f"{where}.elapsed_s", f.elapsed_s)
    _non_negative(f"{where}.limit_s", f.limit_s)
    _need(f.limit_s is None or f.elapsed_s is not None, f"{where}.elapsed_s", "is missing beside limit_s")


def _check_group(g: "GroupResult", where: str) -> None:
    _params(f"{where}.params", g.params)
    _need(bool(g.n_values), f"{where}.n_values", "is empty")
    for i, n in enumerate(g.n_values):
        _positive_int(f"{where}.n_values[{i}]", n)
    _need(g.crossover_n is None or g.crossover_n in g.n_values, f"{where}.crossover_n", "is not one of its N values")
    _need(set(g.marginal_n) <= set(g.n_values), f"{where}.marginal_n", "are not all of its N values")
    _need(set(g.falls_n) <= set(g.n_values), f"{where}.falls_n", "are not all of its N values")
    f = g.fuse_or_capture
    if f is not None:
        _need(f.n in g.n_values, f"{where}.fuse_or_capture.n", "is not one of its N values")
        _need(f.control in CONTROLS, f"{where}.fuse_or_capture.control", f"{f.control!r} is not a control")
        _need(f.speedup > 0, f"{where}.fuse_or_capture.speedup", f"{f.speedup} is not positive")
        _need(len(f.ci) == 2 and 0 <= f.ci[0] <= f.ci[1], f"{where}.fuse_or_capture.ci", f"{f.ci} is not [low, high]")
        _need(f.answer in ("", *CAPTURE_KINDS), f"{where}.fuse_or_capture.answer", f"{f.answer!r} is not an answer")
        _need(
            f.verdict in STRATEGY_VERDICTS,
            f"{where}.fuse_or_capture.verdict",
            f"{f.verdict!r} is not one of {', '.join(STRATEGY_VERDICTS)}",
        )
