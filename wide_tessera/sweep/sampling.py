"""A point's timing: its functions timed together until its decision settles (results.decisions)
or its budget, with what the settled points of the pass lent it, is spent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from ..core.roles import BASELINE, CONTROLS
from ..measurement.settings import RunSettings
from ..measurement.stages import StageTimeout
from ..measurement.timing import PairedTimings, TimedFunctionError, measure_paired
from ..results.decisions import stop_rule
from ..results.schema import Failure
from .failures import failure_of, release_memory

__all__ = ["TimeBank", "measure_until_healthy"]


@dataclass
class TimeBank:
    """Sampling time the settled points of a pass left unused, lent to points still open: a
    point may sample up to five times its own budget while the bank holds the time."""

    saved_s: float = 0.0

    def allowance(self, budget_s: float) -> float:
        return min(self.saved_s, 4 * budget_s)

    def account(self, budget_s: float, sampled_s: float) -> None:
        self.saved_s = max(0.0, self.saved_s + budget_s - sampled_s)


def measure_until_healthy(
    timed: Dict[str, Callable[[], object]],
    settings: RunSettings,
    failures: Dict[str, Failure],
    stage: Any,
    on_function: Optional[Callable[[str], None]],
    bank: TimeBank,
    label: Callable[[str], str],
) -> Optional[PairedTimings]:
    """Time the functions together, until the point's decision is settled (results.decisions)
    or its budget, and what the bank lends it, is spent; one that fails is recorded and the
    rest are timed again without it."""
    while BASELINE in timed:
        strategies = [s for s in timed if s != BASELINE and s not in CONTROLS]
        stop = stop_rule(strategies, [c for c in timed if c in CONTROLS], settings)
        budget_s = settings.timing.budget_s * len(timed)
        extra_s = bank.allowance(budget_s) if stop is not None else 0.0
        try:
            timings = measure_paired(timed, settings.device, settings.timing, stage, on_function, stop, extra_s, label)
            bank.account(budget_s, timings.sampled_s)
            return timings
        except StageTimeout as e:  # ran out between samples (the stop rule, the health check): the point's
            failures["point"] = failure_of(e.stage, e)
            return None
        except TimedFunctionError as e:
            culprit = "point" if e.name == BASELINE else e.name
            phase = e.error.stage if isinstance(e.error, StageTimeout) else "measure"
            failures[culprit] = failure_of(phase, e.error, e.name if culprit == "point" else "")
            del timed[e.name]
            release_memory(settings.device)
    return None
