"""The memory budget: a point whose estimated footprint exceeds it is skipped before its N
models are built."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..core import trees
from ..core.job import BenchmarkJob
from ..core.seeding import forked
from ..measurement.modes import TRAINING_MODES
from ..measurement.settings import RunSettings
from ..results.schema import Failure
from ..train.memory import bytes_per_model

__all__ = ["over_budget", "bytes_per_job_model"]


def over_budget(
    job: BenchmarkJob, n: int, params: Dict[str, Any], dtype: torch.dtype, settings: RunSettings
) -> Optional[Failure]:
    """A 'skipped' failure if the point's estimated footprint (N times train.bytes_per_model, from
    one model and one input on the CPU) exceeds the memory budget."""
    if settings.memory_budget is None:
        return None
    estimate = n * bytes_per_job_model(job, params, dtype, settings.mode)
    if estimate <= settings.memory_budget:
        return None
    return Failure(
        "setup",
        "skipped",
        "MemoryBudget",
        f"estimated footprint {estimate / 2**20:.1f} MiB exceeds the memory budget "
        f"{settings.memory_budget / 2**20:.1f} MiB",
    )


def bytes_per_job_model(job: BenchmarkJob, params: Dict[str, Any], dtype: torch.dtype, mode: str) -> int:
    """train.bytes_per_model of the job's model: the train mode steps AdamW (measurement.recipe),
    the other training modes SGD with momentum (measurement.modes.OPTIMIZER)."""
    with forked("cpu"), torch.no_grad():  # what it draws moves none of the point's draws
        model = job.model_factory(**params).to(dtype=dtype)
        x = trees.cast(job.input_factory(1, **params)[0], "cpu", dtype)
        y = trees.call(model.train(job.train), x)
    optimizer = ("adamw" if mode == "train" else "sgd") if mode in TRAINING_MODES else None
    return bytes_per_model(model, x, y, optimizer)
