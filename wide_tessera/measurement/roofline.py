"""How far a timing is from what the device can do: the roofline bound of a call's work.

A call that must do `flops` of arithmetic and move at least `min_bytes` through memory
takes at least max(flops / peak rate, bytes / peak bandwidth). The peaks are measured
here once per device and software (a large matmul per dtype, a large copy counting bytes
read and written), not read off a datasheet, and cached in the user's cache directory.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
from dataclasses_json import dataclass_json

from ..core.environment import capture_environment
from ..core.errors import WideTesseraError
from ..core.files import cache_dir, make_folder
from ..core.job import Work
from ..core.jsonio import read_json, write_json
from .timing import TimingConfig, measure

__all__ = ["Peaks", "Roofline", "roofline", "calibrate", "load_or_calibrate", "cache_path"]

_TIMING = TimingConfig(budget_s=0.5, target_rel_ci=0.02)


@dataclass_json
@dataclass(frozen=True)
class Peaks:
    """Measured ceilings of one device: matmul TFLOP/s per dtype, copy GB/s (read + written)."""

    device_name: str
    software: str
    tflops: Dict[str, float]
    copy_gbps: float
    measured_at: str


@dataclass(frozen=True)
class Roofline:
    """One timing against the bound: achieved rates, the percentage of the bound reached
    (bound time / measured time), and which ceiling binds ('compute' or 'memory')."""

    tflops: float
    gbps: float
    percent_of_bound: float
    bound: str


def roofline(work: Work, ms: float, peaks: Peaks, dtype: str) -> Roofline:
    """`work` done in `ms` against the device's `peaks` for `dtype`."""
    seconds = ms * 1e-3
    compute_s = work.flops / (peaks.tflops[dtype] * 1e12)
    memory_s = work.min_bytes / (peaks.copy_gbps * 1e9)
    return Roofline(
        tflops=work.flops / seconds / 1e12,
        gbps=work.min_bytes / seconds / 1e9,
        percent_of_bound=100.0 * max(compute_s, memory_s) / seconds,
        bound="compute" if compute_s >= memory_s else "memory",
    )


def calibrate(device: str) -> Peaks:
    """Measure the peaks: a large matmul per dtype (random data: zeros run faster than real
    data on some GPUs) and a large copy. A few seconds on a 2-core CPU or an H100."""
    cuda = torch.device(device).type == "cuda"
    size, copy_bytes = (8192, 2**31) if cuda else (1024, 2**28)
    # A CPU emulates half types (a 1024^3 bfloat16 matmul took 2 s on the 2-core CI machine,
    # 180x float32's time), and presets do not run them there: float32 only.
    dtypes = ["float32", "bfloat16", "float16"] if cuda else ["float32"]
    tflops = {}
    with torch.no_grad():
        for name in dtypes:
            dtype = getattr(torch, name)
            a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
            tflops[name] = 2 * size**3 / (measure(lambda a=a, b=b: a @ b, device, _TIMING).median_ms * 1e-3) / 1e12
        src = torch.empty(copy_bytes // 4, device=device)
        dst = torch.empty_like(src)
        copy_ms = measure(lambda: dst.copy_(src), device, _TIMING).median_ms
    env = capture_environment(device)
    return Peaks(
        device_name=env.device_name,
        software=_software(),
        tflops=tflops,
        copy_gbps=2 * copy_bytes / (copy_ms * 1e-3) / 1e9,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def cache_path() -> Path:
    """peaks.json in the per-user cache directory (files.cache_dir)."""
    return cache_dir() / "peaks.json"


def load_or_calibrate(device: str) -> Peaks:
    """The cached peaks of this device and software, else calibrated now and cached.
    A cache that cannot be read is measured again and rewritten, never an error."""
    key = f"{capture_environment(device).device_name} | {_software()}"
    path = cache_path()
    try:
        cached: Dict[str, dict] = read_json(path, str(path), "a roofline cache") if path.exists() else {}
        if not isinstance(cached, dict):
            raise WideTesseraError("not an object")
    except WideTesseraError:
        cached = {}
    entry = cached.get(key)
    if isinstance(entry, dict):
        try:
            return Peaks(**entry)
        except TypeError:
            pass
    peaks = calibrate(device)
    cached[key] = asdict(peaks)
    make_folder(path.parent, "cache folder")
    write_json(path, cached, None)  # a cache in a folder of ours, under a name of ours
    return peaks


def _software() -> str:
    triton: Optional[str]
    try:
        import triton

        triton = triton.__version__
    except ImportError:
        triton = None
    return f"torch {torch.__version__}, triton {triton}"
