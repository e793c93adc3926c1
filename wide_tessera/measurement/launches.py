"""How many kernels a call launches: the plainest explanation of a fusion win (N x k launches against k).

On CUDA, the device kernels the profiler saw per call (memcpy and memset included:
they are launches too). On a CPU, the ATen operators dispatched per call, counting
only top-level ones (an operator called inside another, as aten::linear calls
aten::addmm, is part of its caller's dispatch).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .memory import peak_bytes, peak_memory, profiled, stderr_silenced

__all__ = ["count_launches", "launches_and_peak"]

# Profiled calls per count on CUDA: a call whose launches vary (a library choosing its kernels)
# shows as a fraction. The ATen operators a CPU call dispatches do not vary from call to call
# once the first call is done, so one profiled call counts them (the quick preset profiled
# 505 callables: 11.7 s with three calls each).
_CUDA_CALLS = 3


def count_launches(fn: Callable[[], object], device: str) -> float:
    """Kernels launched (CUDA) or top-level ATen operators dispatched (CPU) per call of `fn`."""
    fn()  # the first call may compile, tune or allocate: not what a call costs
    if torch.device(device).type != "cuda":
        return _top_level_aten(profiled(fn)[1])
    with stderr_silenced(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(_CUDA_CALLS):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_type == DeviceType.CUDA for e in prof.events()) / _CUDA_CALLS


def launches_and_peak(fn: Callable[[], object], device: str) -> Tuple[float, int]:
    """`count_launches` and the memory peak (`memory.peak_memory`) of a call of `fn` that has run
    before (a timed function, after its timing). On a CPU one profiled call gives both: profiled
    apart, with a call to warm up, they took 5.8 s of a 95 s quick run of all ops (2-core CPU,
    2026-11-27); one call saves about 2.5 s of it."""
    if torch.device(device).type == "cuda":
        return count_launches(fn, device), peak_memory(fn, device)[1]
    events = profiled(fn)[1]
    return _top_level_aten(events), peak_bytes(events)


def _top_level_aten(events: Sequence[Any]) -> float:
    """ATen operators not running inside another one on their thread: an operator starts
    inside another when it starts before that one ends (outer ones first where two start
    at once). A float, as CUDA's counts per call are: a result holds launches as floats, and
    an int saved as 18 would load as 18.0, no longer the result that was saved."""
    count, running = 0, {}  # thread -> end times of the ATen operators open at this point
    for e in sorted(
        (e for e in events if e.name().startswith("aten::")), key=lambda e: (e.start_ns(), -e.duration_ns())
    ):
        open_ends = running.setdefault(e.start_thread_id(), [])
        while open_ends and open_ends[-1] <= e.start_ns():
            open_ends.pop()
        count += not open_ends
        open_ends.append(e.start_ns() + e.duration_ns())
    return float(count)
