"""Peak tensor memory of one call: the CUDA allocator's peak on a GPU, profiler memory events on a CPU."""

from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from typing import Callable, Iterator, Tuple, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["peak_memory", "memory_method", "stderr_silenced"]

T = TypeVar("T")


def memory_method(device: str) -> str:
    return "cuda_max_memory_allocated" if torch.device(device).type == "cuda" else "cpu_profiler_events"


def peak_memory(fn: Callable[[], T], device: str) -> Tuple[T, int]:
    """Call `fn` once; return its result and the most tensor memory it held above what was held before.

    Outputs count: they are memory the call leaves behind. On a CPU the peak is
    taken at operator granularity, so a temporary that lives inside one C++
    kernel is not seen.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    with stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # Each op's own allocations, and frees ("[memory]" events), in time order: the running sum peaks at the peak.
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    running = itertools.accumulate(e.self_cpu_memory_usage for e in events)
    return result, max(0, max(running, default=0))


@contextmanager
def stderr_silenced() -> Iterator[None]:
    # The profiler's C++ side logs two lines to stderr per use (profiler_start/stop), with no
    # setting to turn them off; they would bury the progress lines.
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
