"""Results as a tidy table: one row per (op, N, parameters, strategy), one column per fact.

The form pandas, a spreadsheet or a SQL table takes without a loop of one's own:
`rows` gives plain dicts, `to_dataframe` a pandas DataFrame (the `pandas` extra), and
`wide_tessera show FILE --format csv` the same rows as CSV that `pd.read_csv` reads back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Sequence

from ..core.errors import WideTesseraError
from ..core.roles import BASELINE, CONTROLS
from .text import controls_run

if TYPE_CHECKING:
    import pandas

    from ..results.schema import BenchmarkResult, PointResult

__all__ = ["rows", "to_dataframe", "column_order", "point_status", "COLUMNS"]

# The fixed columns, in order; each parameter of the op is a column of its own after `n`.
COLUMNS = (
    "run_id",
    "op",
    "preset",
    "device",
    "device_name",
    "compile",
    "mode",
    "n",
    # parameters here
    "strategy",
    "role",
    "median_ms",
    "median_ci_low_ms",
    "median_ci_high_ms",
    "p10_ms",
    "p90_ms",
    "p99_ms",
    "samples",
    "cv",
    "speedup",
    "speedup_ci_low",
    "speedup_ci_high",
    "verdict",
    "correct",
    "max_rel_error",
    "max_abs_error",
    "peak_memory_bytes",
    "launches",
    "energy_mj",
    "power_w",
    "first_call_s",
    "winner",
    "status",
    "failure",
)
_BEFORE_PARAMS = COLUMNS.index("n") + 1


def point_status(point: "PointResult") -> str:
    """'skipped' or 'failed' (no timings), 'disturbed' or 'unstable' (no verdict), else 'measured'."""
    failure = point.failures.get("point")
    if failure is not None:
        return "skipped" if failure.kind == "skipped" else "failed"
    if point.disturbed:
        return "disturbed"
    if point.unstable:
        return "unstable"
    return "measured"


def _role(strategy: str) -> str:
    return BASELINE if strategy == BASELINE else "control" if strategy in CONTROLS else "strategy"


def _param_column(name: str) -> str:
    """A parameter's column: its own name, unless a fixed column has it."""
    return f"param_{name}" if name in COLUMNS else name


def _row(result: "BenchmarkResult", point: "PointResult", strategy: str) -> Dict[str, Any]:
    env = result.environment
    stats = point.stats.get(strategy)
    check = point.checks.get(strategy)
    energy = point.energy.get(strategy)
    failure = point.failures.get(strategy) or point.failures.get("point")
    ci = point.speedup_ci.get(strategy, [None, None])
    row: Dict[str, Any] = {
        "run_id": result.run_id,
        "op": result.op,
        "preset": result.preset,
        "device": env.device,
        "device_name": env.device_name,
        "compile": result.compile,
        "mode": result.mode,
        "n": point.n,
        **{_param_column(k): v for k, v in point.params.items()},
        "strategy": strategy,
        "role": _role(strategy),
    }
    row.update(
        median_ms=stats.median_ms if stats else None,
        median_ci_low_ms=stats.median_ci_ms[0] if stats else None,
        median_ci_high_ms=stats.median_ci_ms[1] if stats else None,
        p10_ms=stats.p10_ms if stats else None,
        p90_ms=stats.p90_ms if stats else None,
        p99_ms=stats.p99_ms if stats else None,
        samples=stats.n_samples if stats else None,
        cv=stats.cv if stats else None,
        speedup=point.speedups.get(strategy),
        speedup_ci_low=ci[0],
        speedup_ci_high=ci[1],
        verdict=point.verdicts.get(strategy),
        # The baseline is the reference: correct by definition wherever it ran.
        correct=bool(point.timings) if strategy == BASELINE else point.correct.get(strategy),
        max_rel_error=check.max_rel_error if check else None,
        max_abs_error=max(check.per_model_abs_error) if check and check.per_model_abs_error else None,
        peak_memory_bytes=point.peak_memory_bytes.get(strategy),
        launches=point.launches.get(strategy),
        energy_mj=energy.mj_per_call if energy else None,
        power_w=energy.watts if energy else None,
        first_call_s=point.first_call_s.get(strategy),
        winner=point.winner if point.timings else None,
        status=point_status(point),
        failure=str(failure) if failure else None,
    )
    return row


def rows(results: Sequence["BenchmarkResult"]) -> List[Dict[str, Any]]:
    """One dict per (result, point, strategy): the baseline, every strategy and every control that ran.

    Every row of a result has the same keys (COLUMNS with the op's parameters after `n`);
    a value the point lacks (a strategy that failed, the baseline's speedup) is None.
    """
    if not isinstance(results, (list, tuple)) or not all(type(r).__name__ == "BenchmarkResult" for r in results):
        raise WideTesseraError(
            f"give a list of BenchmarkResult (load_results(path) reads a file), got {type(results).__name__}"
        )
    out = []
    for result in results:
        names = [BASELINE, *result.strategies, *controls_run(result)]
        out += [_row(result, p, s) for p in result.points for s in names]
    return out


def column_order(table: Sequence[Dict[str, Any]]) -> List[str]:
    """The fixed columns with every parameter column (of every op in `table`) after `n`."""
    params = [c for c in dict.fromkeys(k for row in table for k in row) if c not in COLUMNS]
    return [*COLUMNS[:_BEFORE_PARAMS], *params, *COLUMNS[_BEFORE_PARAMS:]]


def to_dataframe(results: Sequence["BenchmarkResult"]) -> "pandas.DataFrame":
    """The tidy rows of `results` (several ops make one frame; a parameter an op lacks is empty there)."""
    try:
        import pandas
    except ImportError:
        raise WideTesseraError(
            "to_dataframe needs pandas: pip install 'wide_tessera[pandas]' (or use to_rows(), plain dicts)"
        ) from None
    table = rows(results)
    return pandas.DataFrame(table, columns=column_order(table) if table else list(COLUMNS))
