"""Peak tensor memory of one call: the CUDA allocator's peak on a GPU, profiler memory events on a CPU."""

from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Sequence, Tuple, TypeVar

import torch
from torch.autograd import profiler as autograd_profiler

__all__ = ["peak_memory", "peak_bytes", "memory_method", "profiled", "stderr_silenced"]

T = TypeVar("T")


def memory_method(device: str) -> str:
    return "cuda_max_memory_allocated" if torch.device(device).type == "cuda" else "cpu_profiler_events"


def peak_memory(fn: Callable[[], T], device: str) -> Tuple[T, int]:
    """Call `fn` once; return its result and the most tensor memory it held above what was held before.

    Outputs count: they are memory the call leaves behind. On a CPU the peak is the
    running sum of the profiler's allocation and free events in time order: a temporary
    inside an operator is seen, memory a library allocates itself (a BLAS workspace) is not.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    result, events = profiled(fn)
    return result, peak_bytes(events)


def peak_bytes(events: Sequence[Any]) -> int:
    """The most memory held at once over a CPU profile taken with profile_memory: the running sum
    of its allocation and free events in time order."""
    allocations = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    running = itertools.accumulate(e.nbytes() for e in allocations)  # frees are negative
    return max(0, max(running, default=0))


def profiled(fn: Callable[[], T]) -> Tuple[T, List[Any]]:
    """One call of `fn` under the CPU profiler, with memory events: its result, and the events as
    the profiler recorded them, unparsed (prof.events() builds a Python event tree first, which
    took 10 of the 15 s of one gru quick point at N=16: 23,000 events per call of the baseline;
    4.7 s to count its launches, 0.08 s from these).

    torch.autograd.profiler's profile, which torch.profiler's wraps: the wrapper's start asks
    `hasattr(torch, "_inductor")`, which imports torch._inductor and torch._dynamo, 1.7 s of the
    first profiled call in every process (2-core CPU, torch 2.13)."""
    with stderr_silenced(), autograd_profiler.profile(use_kineto=True, profile_memory=True) as prof:
        result = fn()
    return result, prof.kineto_results.events()


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
