"""Time limits per stage of a point, enforced in-process with SIGALRM where Python code can be interrupted."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from dataclasses_json import dataclass_json

from ..core.errors import MeasurementFault
from ..core.user_input import check_number

__all__ = ["StageTimeouts", "StageTimeout", "STAGES", "stage_limit"]

STAGES = ("setup", "check", "warmup", "measure")


@dataclass_json
@dataclass(frozen=True)
class StageTimeouts:
    """Seconds each stage of a point may take, before `multiplier` scales them all."""

    setup_s: float = 120.0
    check_s: float = 120.0
    warmup_s: float = 60.0
    measure_s: float = 300.0
    multiplier: float = 1.0

    def __post_init__(self) -> None:
        # A day per stage, and a multiplier of 1000, are far beyond any real need: larger is a typo.
        for stage in STAGES:
            check_number(f"{stage}_s", getattr(self, f"{stage}_s"), 0, 86400, what="a number of seconds")
        check_number("multiplier", self.multiplier, 0, 1000)

    def limit(self, stage: str) -> float:
        return getattr(self, f"{stage}_s") * self.multiplier


class StageTimeout(MeasurementFault):
    def __init__(self, stage: str, limit_s: float, elapsed_s: float):
        super().__init__(f"{stage} exceeded its {limit_s:.1f} s limit")
        self.stage, self.limit_s, self.elapsed_s = stage, limit_s, elapsed_s


# Called as each stage starts: (stage, strategy or None, limit in seconds). The isolated
# worker uses it to tell its parent what to time out.
StageObserver = Callable[[str, Optional[str], float], None]


@contextmanager
def stage_limit(
    stage: str, timeouts: StageTimeouts, strategy: Optional[str] = None, observer: Optional[StageObserver] = None
) -> Iterator[None]:
    """Raise StageTimeout in this thread if the block runs past the stage's limit.

    A hang inside a C call cannot be interrupted this way; `--isolate` covers that by
    killing the worker process from outside.
    """
    limit = timeouts.limit(stage)
    if observer is not None:
        observer(stage, strategy, limit)
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return
    started = time.perf_counter()

    def on_alarm(signum: int, frame: object) -> None:
        raise StageTimeout(stage, limit, time.perf_counter() - started)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
