"""Timers: `triton.testing.do_bench` or CUDA events on a GPU, a calibrated perf_counter loop on a CPU."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from .stats import TimingStats

__all__ = ["TimingConfig", "measure", "cuda_timer_name"]

# An L2 flush buffer larger than any current GPU's L2 (H100: 50 MB, H200: 60 MB).
_L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TimingConfig:
    """How long and how often to sample one function."""

    warmup_s: float = 0.05
    budget_s: float = 0.3
    min_samples: int = 7
    max_samples: int = 500
    # A CPU sample runs the function in a loop for at least this long, so that
    # perf_counter's own cost (well under a microsecond) stays below 0.1% of it.
    min_sample_s: float = 1e-3


def measure(fn: Callable[[], object], device: str = "cpu", config: Optional[TimingConfig] = None) -> TimingStats:
    """Time `fn()` on `device` and return every sample with its statistics (ms per call)."""
    config = config or TimingConfig()
    if torch.device(device).type == "cuda":
        samples, timer, calls = _cuda_samples(fn, config)
    else:
        samples, timer, calls = _cpu_samples(fn, config)
    return TimingStats.from_samples(samples, timer, calls)


@contextmanager
def _gc_paused() -> Iterator[None]:
    # A collection in the middle of a sample would be charged to whichever function ran then.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _cpu_samples(fn: Callable[[], object], config: TimingConfig) -> Tuple[List[float], str, int]:
    with _gc_paused():
        calls = 1
        warm_until = time.perf_counter() + config.warmup_s
        while True:  # calibrate: double the loop until one sample lasts long enough (this also warms up)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = time.perf_counter() - t0
            if elapsed >= config.min_sample_s and time.perf_counter() >= warm_until:
                break
            if elapsed < config.min_sample_s:
                calls *= 2
        samples: List[float] = []
        deadline = time.perf_counter() + config.budget_s
        while len(samples) < config.max_samples and (
            len(samples) < config.min_samples or time.perf_counter() < deadline
        ):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return samples, "cpu_perf_counter", calls


def cuda_timer_name() -> str:
    """The GPU timer `measure` will use: do_bench when triton imports, else CUDA events."""
    try:
        import triton.testing  # noqa: F401
    except ImportError:
        return "cuda_event"
    return "triton_do_bench"


def _cuda_samples(fn: Callable[[], object], config: TimingConfig) -> Tuple[List[float], str, int]:
    if cuda_timer_name() == "triton_do_bench":
        import triton.testing

        # do_bench warms up, flushes L2 before every call, and times each call with CUDA events.
        samples = triton.testing.do_bench(
            fn, warmup=config.warmup_s * 1e3, rep=config.budget_s * 1e3, return_mode="all"
        )
        return [float(s) for s in samples], "triton_do_bench", 1
    return _cuda_event_samples(fn, config), "cuda_event", 1


def _cuda_event_samples(fn: Callable[[], object], config: TimingConfig) -> List[float]:
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    warm_until = time.perf_counter() + config.warmup_s
    while time.perf_counter() < warm_until:
        fn()
    torch.cuda.synchronize()
    pairs = []
    deadline = time.perf_counter() + config.budget_s
    while len(pairs) < config.max_samples and (len(pairs) < config.min_samples or time.perf_counter() < deadline):
        flush.zero_()  # outside the timed region: every sample starts with a cold L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
        if len(pairs) % 32 == 0:
            torch.cuda.synchronize()  # keep the wall-clock deadline honest
    torch.cuda.synchronize()
    return [float(s.elapsed_time(e)) for s, e in pairs]
