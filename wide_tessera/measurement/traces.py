"""Traces to open in a profiler: a few calls of each timed callable under torch.profiler, written
as Chrome/Perfetto JSON (chrome://tracing, ui.perfetto.dev), after the point's timings and
never inside them; and, on CUDA, an NVTX range around every timed sample, so that
`nsys profile wide_tessera benchmark ...` shows the baseline and each strategy by name.
"""

from __future__ import annotations

import re
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, ContextManager, Dict, Iterator, List

import torch
from torch.profiler import ProfilerActivity, profile

from ..core.files import make_folder
from .memory import stderr_silenced

__all__ = ["trace_name", "write_traces", "nvtx_range"]

# Calls per trace: one shows what a call does; three show whether every call does the same.
TRACED_CALLS = 3


def trace_name(op: str, n: int, params: Dict[str, object], callable_name: str) -> str:
    """'gemm_N4_batch=16_in_features=256_dtype=float32_bmm': how a trace and an NVTX range are named."""
    text = "_".join([op, f"N{n}", *(f"{k}={v}" for k, v in params.items()), callable_name])
    return re.sub(r"[^A-Za-z0-9=._-]+", "-", text)


def write_traces(
    callables: Dict[str, Callable[[], object]], directory: Path, stem: Callable[[str], str], device: str
) -> List[Path]:
    """One trace per callable, of TRACED_CALLS calls, in `directory` (made where missing); the
    paths written."""
    make_folder(directory, "traces folder")
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    written = []
    for name, fn in callables.items():
        with stderr_silenced(), profile(activities=activities) as prof:
            for _ in range(TRACED_CALLS):
                fn()
            if cuda:
                torch.cuda.synchronize()
        path = directory / f"{stem(name)}.json"
        prof.export_chrome_trace(str(path))
        written.append(path)
    return written


@contextmanager
def _range(label: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(label)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def nvtx_range(label: str, device: str) -> ContextManager[None]:
    """An NVTX range named `label` on CUDA (what Nsight Systems shows); nothing elsewhere."""
    return _range(label) if torch.device(device).type == "cuda" else nullcontext()
