"""How many kernels a call launches: the plainest explanation of a fusion win (N x k launches against k).

On CUDA, the device kernels the profiler saw per call (memcpy and memset included:
they are launches too). On a CPU, the ATen operators dispatched per call, counting
only top-level ones (an operator called inside another, as aten::linear calls
aten::addmm, is part of its caller's dispatch).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .memory import stderr_silenced

__all__ = ["count_launches"]

# Profiled calls per count: a call whose launches vary (a cache warming) shows as a fraction.
_CALLS = 3


def count_launches(fn: Callable[[], object], device: str) -> float:
    """Kernels launched (CUDA) or top-level ATen operators dispatched (CPU) per call of `fn`."""
    cuda = torch.device(device).type == "cuda"
    fn()  # the first call may compile, tune or allocate: not what a call costs
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with stderr_silenced(), profile(activities=activities) as prof:
        for _ in range(_CALLS):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        launched = [e for e in events if e.device_type == DeviceType.CUDA]
    else:
        launched = [e for e in events if e.name.startswith("aten::") and not _inside_aten(e)]
    return len(launched) / _CALLS


def _inside_aten(event: object) -> bool:
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False
