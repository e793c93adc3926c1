"""What goes wrong at a point, as the point's Failure: an exception, a stage over its limit, a
strategy that cannot apply here; and the memory a failed strategy held, freed for the next."""

from __future__ import annotations

import gc

import torch

from ..core.errors import one_line, vmap_limitation
from ..measurement.stages import StageTimeout
from ..measurement.timing import NotCapturable
from ..results.schema import Failure

__all__ = ["failure_of", "unavailable", "release_memory"]


def unavailable(strategy: str, why: object) -> Failure:
    """A strategy that cannot apply here (a need unmet, NotApplicable): skipped with the reason, before any timing."""
    return Failure("setup", "skipped", "Unavailable", f"{strategy}: {why}")


def failure_of(stage: str, error: BaseException, name: str = "") -> Failure:
    if isinstance(error, StageTimeout):
        return Failure(error.stage, "timeout", "Timeout", str(error), error.elapsed_s, error.limit_s)
    if isinstance(error, NotCapturable):  # skipped, with the reason: nothing it computed was wrong
        return Failure(stage, "skipped", "NotCapturable", f"{name}: {error}" if name else str(error))
    limitation = vmap_limitation(error)
    if limitation is not None:  # torch's, not the strategy's: skipped, with torch's reason
        return Failure(stage, "skipped", "VmapLimitation", f"{name}: {limitation}" if name else limitation)
    return Failure(stage, "error", type(error).__name__, one_line(error).partition(": ")[2])


def release_memory(device: str) -> None:
    # After an out-of-memory error the failed strategy's tensors are garbage; free them
    # before the next strategy needs the room.
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
