"""The two calls most users need: benchmark a registered op, or any nn.Module class."""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from . import ops  # noqa: F401  (registers the built-in ops)
from .measurement import timing
from .sweep.isolation import call_isolated
from .core.job import DTYPES, BenchmarkJob
from .measurement.modes import TRAINING_MODES, check_mode
from .ops.registry import get_op
from .sweep.runner import run
from .results.schema import BenchmarkResult
from .measurement.stages import StageTimeouts
from .core.stats import TimingStats
from .measurement.timing import TimingConfig
from .core.user_input import check_instance, check_number, check_seed
from .core.errors import WideTesseraError
from .widen.custom import custom_job

__all__ = ["benchmark", "benchmark_custom", "measure", "resolve_device", "build_job", "build_custom_job"]


def resolve_device(device: Optional[str]) -> str:
    """None means CUDA when available, else CPU; anything else must exist on this machine."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        d = torch.device(device) if isinstance(device, (str, torch.device)) else None
    except (RuntimeError, TypeError):
        d = None
    # torch accepts 'cpu:1', but there is one CPU device: an index there is a typo.
    if d is None or d.type not in ("cpu", "cuda") or (d.type == "cpu" and d.index is not None):
        raise WideTesseraError(f"unknown device {device!r} (valid: cpu, cuda, cuda:N)")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise WideTesseraError(f"device {device!r}: CUDA is not available on this machine (valid here: cpu)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise WideTesseraError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return str(d)


def _supported_dtypes(device: str) -> Sequence[str]:
    if torch.device(device).type == "cuda" and not torch.cuda.is_bf16_supported():
        return [d for d in DTYPES if d != "bfloat16"]
    return list(DTYPES)


def _preset_dtypes(device: str) -> Sequence[str]:
    # Most CPUs emulate bfloat16/float16 convolutions and matmuls (600 ms for a conv1d that takes
    # 25 ms in float32 on the 2-core CI machine): slow and unrepresentative, so presets leave them
    # to GPUs. Asking for them with dtype=... still runs them on a CPU.
    if torch.device(device).type == "cpu":
        return ["float32"]
    return _supported_dtypes(device)


def build_job(name: str, preset: str, device: str, overrides: Dict[str, Any], verbose: bool = True) -> BenchmarkJob:
    """The op's job for `preset` with `overrides`, its dtypes limited to what `device` runs well.

    A preset's dtypes that the device lacks (or, on a CPU, emulates) are dropped with a note;
    an explicitly asked-for dtype the device lacks is an error.
    """
    job = get_op(name).benchmark_job(preset, **overrides)
    dtypes = job.sweep.axes.get("dtype", ())
    if "dtype" in overrides:
        supported = _supported_dtypes(device)
        for d in dtypes:
            if d not in supported:
                raise WideTesseraError(f"dtype {d!r} is not supported on {device} (valid: {', '.join(supported)})")
        return job
    kept = [d for d in dtypes if d in _preset_dtypes(device)]
    if dtypes and not kept:
        raise WideTesseraError(
            f"preset {preset!r} of {job.op} has only dtypes {', '.join(dtypes)}, which presets do not run on "
            f"{device}; ask for them with dtype=... (valid on {device}: {', '.join(_supported_dtypes(device))})"
        )
    if len(kept) < len(dtypes):
        dropped = ", ".join(d for d in dtypes if d not in kept)
        if verbose:
            print(
                f"[{job.op}] preset {preset}: skipping {dropped} on {device} (ask with dtype=... to run it)",
                file=sys.stderr,
            )
        job.sweep = job.sweep.with_overrides(dtype=kept)
    return job


def benchmark(
    name: str,
    preset: str = "full",
    device: Optional[str] = None,
    verbose: bool = True,
    seed: int = 0,
    timing: Optional[TimingConfig] = None,
    isolate: bool = False,
    timeouts: Optional[StageTimeouts] = None,
    memory_budget: Optional[int] = None,
    confirm: Optional[str] = None,
    compile: str = "none",
    controls: Optional[bool] = None,
    roofline: bool = False,
    mode: str = "inference",
    energy: bool = False,
    **overrides: Any,
) -> BenchmarkResult:
    """Benchmark a registered op: N separate calls against each wide strategy, over the preset's sweep.

    `overrides` replace sweep axes, e.g. n_values=[8, 16], channels=[32], dtype=['float32'].
    `timing` sets when sampling stops (TimingConfig: CI target, time budget, CUDA graphs).
    `isolate` runs the points in a worker process, so a hang or a crash costs one strategy;
    `timeouts` limits each stage of a point (StageTimeouts); `memory_budget` (bytes) skips
    points whose estimated footprint is larger. `confirm` says which points are measured
    again after the sweep ('deciding', 'all', 'none'); where the passes disagree the
    point is unstable and never counts as a win. Where `timing`, `confirm` and `controls` are
    not given, the preset's settings apply (sweep.point.PRESET_RUNS): `ci`, a smoke run,
    samples 0.1 s per function, confirms nothing and times no controls; `quick` samples 0.25 s;
    other runs 0.5 s, confirm the deciding points and time the controls. `compile` applies torch.compile in that mode
    ('default', 'reduce-overhead', 'max-autotune'; 'none' for eager) to the baseline and every
    strategy alike. `controls` (default on) also times the baseline loop captured in one CUDA
    graph (CUDA only) and compiled: cheaper loops that fuse nothing, shown beside the strategies.
    `roofline` measures the device's peaks (once per device and software, cached) and shows
    each timing as a percentage of its roofline bound. `mode` says what one timed call does:
    'inference' (under no_grad), 'forward' (autograd recording), 'backward' (the backward pass
    alone), 'forward_backward', or 'train_step' (forward, backward, an SGD step); the training
    modes also check every model's gradients, buffers and updated parameters (see measurement.modes).
    `energy` (CUDA, with NVML) also measures each callable's energy per call and power at every
    point, in windows of its own after the timings (see measurement.energy: about 3 s per callable).
    """
    _check_settings(seed, timing, timeouts, memory_budget, mode)
    device = resolve_device(device)
    job = build_job(name, preset, device, overrides, verbose)
    return run(
        job, device, verbose, seed, timing, timeouts, memory_budget, isolate, confirm, compile, controls, roofline, mode,
        energy,
    )


def benchmark_custom(
    model_class: type,
    input_shape: Any,
    n_values: Sequence[int],
    name: Optional[str] = None,
    device: Optional[str] = None,
    verbose: bool = True,
    dtype: Any = "float32",
    seed: int = 0,
    timing: Optional[TimingConfig] = None,
    isolate: bool = False,
    timeouts: Optional[StageTimeouts] = None,
    memory_budget: Optional[int] = None,
    confirm: Optional[str] = None,
    compile: str = "none",
    controls: Optional[bool] = None,
    input_dtype: Any = None,
    int_high: Optional[int] = None,
    input_factory: Optional[Callable[[], Any]] = None,
    randomness: str = "error",
    train: bool = False,
    mode: str = "inference",
    energy: bool = False,
    **model_kwargs: Any,
) -> BenchmarkResult:
    """Benchmark N copies of `model_class(**model_kwargs)` made wide two ways: `vmap` (torch.func over
    the whole model) and `surgery` (each layer an op fuses swapped for its wide module).

    `input_shape` is the shape of one model's input, or a list of shapes for a module of
    several inputs; each of the N models gets its own. `input_dtype` is 'float' (the run's
    dtype; the default), 'int64', 'int32' or 'bool', one for all inputs or a list of one per
    input; integer inputs are drawn from [0, int_high). Or `input_factory()` (with
    input_shape=None) returns one model's input: a tensor or a tuple of tensors.
    `randomness` is vmap's ('error', 'different', 'same') for models that draw random
    numbers; `train` runs the models in train mode (dropout active) in the inference mode too
    (the training modes always do). `name` defaults to the class's name. The other settings
    are `benchmark`'s.
    """
    _check_settings(seed, timing, timeouts, memory_budget, mode)
    device = resolve_device(device)
    job = build_custom_job(
        model_class,
        input_shape,
        n_values,
        name,
        dtype,
        model_kwargs,
        isolate,
        timeouts,
        input_dtype=input_dtype,
        int_high=int_high,
        input_factory=input_factory,
        randomness=randomness,
        train=train or mode in TRAINING_MODES,
    )
    return run(
        job, device, verbose, seed, timing, timeouts, memory_budget, isolate, confirm, compile, controls, mode=mode,
        energy=energy,
    )


def build_custom_job(
    model_class: type,
    input_shape: Any,
    n_values: Sequence[int],
    name: Optional[str],
    dtype: Any,
    model_kwargs: Dict[str, Any],
    isolate: bool,
    timeouts: Optional[StageTimeouts],
    **inputs: Any,
) -> BenchmarkJob:
    """The job behind benchmark_custom (and the `custom` command); `inputs` are custom_job's input options.

    The module is tried on one input first, under `isolate` in a worker process within the
    setup stage's time limit, so a module that crashes or hangs cannot take the caller with it.
    """
    limit = (timeouts or StageTimeouts()).limit("setup")
    what = f"trying {getattr(model_class, '__name__', model_class)} on one input"
    run_check = partial(call_isolated, limit_s=limit, what=what) if isolate else (lambda check: check())
    return custom_job(model_class, input_shape, n_values, name, dtype, model_kwargs, run_check, **inputs)


def measure(fn: Callable[[], object], device: str = "cpu", config: Optional[TimingConfig] = None) -> TimingStats:
    """Time `fn()` on `device` (see `wide_tessera.measurement.timing.measure`), after checking the arguments."""
    if not callable(fn):
        raise WideTesseraError(f"measure: fn={fn!r} is not callable; give a function of no arguments")
    check_instance("config", config, TimingConfig)
    return timing.measure(fn, resolve_device(device), config)


def _check_settings(
    seed: int, timing: Optional[TimingConfig], timeouts: Optional[StageTimeouts], memory_budget: Optional[int], mode: str
) -> None:
    """The run's settings, checked before any model is built."""
    check_seed(seed)
    check_mode(mode)
    check_instance("timing", timing, TimingConfig)
    check_instance("timeouts", timeouts, StageTimeouts)
    if memory_budget is not None:
        check_number("memory_budget", memory_budget, 0, 2**60, integer=True, what="a number of bytes")
