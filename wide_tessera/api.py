"""The two calls most users need: benchmark a registered op, or any nn.Module class."""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import nn

from . import ops  # noqa: F401  (registers the built-in ops)
from .core.errors import WideTesseraError, unknown
from .core.job import DTYPES, BenchmarkJob, SweepParams
from .core.stats import TimingStats
from .core.user_input import check_instance
from .measurement import timing
from .measurement.modes import TRAINING_MODES
from .measurement.settings import RunSettings, resolve_device
from .measurement.timing import TimingConfig
from .ops.registry import get_op
from .results.schema import BenchmarkResult
from .sweep.isolation import call_isolated
from .sweep.runner import run
from .widen.custom import custom_job, factory_name

__all__ = ["benchmark", "benchmark_custom", "measure", "build_job", "build_custom_job", "preset_sweep"]


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


def _kept_dtypes(op: str, preset: str, dtypes: Sequence[str], device: str) -> Sequence[str]:
    """The preset's dtypes that presets run on `device`; an error where none is."""
    kept = [d for d in dtypes if d in _preset_dtypes(device)]
    if dtypes and not kept:
        raise WideTesseraError(
            f"preset {preset!r} of {op} has only dtypes {', '.join(dtypes)}, which presets do not run on "
            f"{device}; ask for them with dtype=... (valid on {device}: {', '.join(_supported_dtypes(device))})"
        )
    return kept


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
    kept = _kept_dtypes(job.op, preset, dtypes, device)
    if len(kept) < len(dtypes):
        dropped = ", ".join(d for d in dtypes if d not in kept)
        if verbose:
            print(
                f"[{job.op}] preset {preset}: skipping {dropped} on {device} (ask with dtype=... to run it)",
                file=sys.stderr,
            )
        job.sweep = job.sweep.with_overrides(dtype=kept)
    return job


def preset_sweep(name: str, preset: str, device: str) -> SweepParams:
    """The sweep a run of `preset` has on `device` (build_job's, without a note of the dtypes left
    out), its values not checked by the op: hf_experts' check imports transformers and builds
    each family's experts, 10.7 s of `wide_tessera list`'s 33.7 s under cProfile (2-core CPU,
    loaded), and a preset's own values are the op's."""
    cls = get_op(name)
    sweep = cls.BENCHMARK_SWEEPS[preset]
    dtypes = sweep.axes.get("dtype", ())
    kept = _kept_dtypes(cls.NAME, preset, dtypes, device)
    return sweep.with_overrides(dtype=kept) if len(kept) < len(dtypes) else sweep


def benchmark(
    name: str,
    preset: Optional[str] = None,
    *,
    settings: Optional[RunSettings] = None,
    verbose: bool = True,
    **options: Any,
) -> BenchmarkResult:
    """Benchmark a registered op: N separate calls against each wide strategy, over the preset's sweep.

    `preset`: ci, quick or full (the default). The run's settings are one typed object,
    `settings=wt.RunSettings.of(preset='quick', seed=3, mode='train')`, which carries the preset
    and can be kept for several runs; or, for short, keywords among `options` (device, seed,
    timing, mode, confirm, regret, ...: any field of RunSettings), the preset's defaults filling
    the rest. The other
    `options` override the sweep's axes (n_values=[8, 16], channels=[32], dtype=['float32']).
    Progress goes to stderr unless `verbose=False`.
    """
    given, overrides = RunSettings.split(options)
    settings = _run_settings(settings, given, preset, "full")
    assert settings.preset is not None and settings.device is not None  # _run_settings names both
    _check_names(name, settings.preset, overrides)
    job = build_job(name, settings.preset, settings.device, overrides, verbose)
    return run(job, settings, verbose=verbose)


def _run_settings(
    settings: Optional[RunSettings], given: Dict[str, Any], preset: Optional[str], default: str
) -> RunSettings:
    """The run's settings: `settings` as made (its preset None is `default`, whose defaults it
    holds), or the keywords `given` over `preset`'s defaults; not both, and its device one this
    machine has. A preset given twice, or a setting beside `settings`, is one line naming it."""
    if settings is None:
        return RunSettings.of(preset=default if preset is None else preset, **given)
    check_instance("settings", settings, RunSettings)
    if given:
        key = next(iter(given))
        raise WideTesseraError(
            f"{key}={given[key]!r} beside settings=: give every run setting in one place "
            f"(RunSettings.of(..., {key}={given[key]!r}), or keywords without settings=)"
        )
    if preset is not None:
        raise WideTesseraError(
            f"preset={preset!r} beside settings=: the settings carry the preset their defaults are "
            f"filled for (RunSettings.of(preset={preset!r}, ...))"
        )
    made = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}  # through .of's checks
    return RunSettings.of(**{**made, "preset": default if settings.preset is None else settings.preset})


def _check_names(name: str, preset: str, overrides: Dict[str, Any]) -> None:
    """That each keyword that is no run setting is a sweep axis of the op's preset, else one line
    naming both lists: `seed` mistyped as `sed=3` was "unknown sweep axis 'sed'", listing the axes
    alone. (An unknown op or preset is build_job's to name.)"""
    sweep = get_op(name).BENCHMARK_SWEEPS.get(preset) if isinstance(preset, str) else None
    if sweep is None:
        return
    axes = ["n_values", *sweep.axes]
    for key in overrides:
        if key not in axes:
            raise unknown("run setting or sweep axis", key, [*RunSettings.names(), *axes])


def benchmark_custom(
    model_class: Callable[..., nn.Module],
    input_shape: Any,
    n_values: Sequence[int],
    *,
    model_kwargs: Optional[Dict[str, Any]] = None,
    name: Optional[str] = None,
    dtype: Any = "float32",
    input_dtype: Any = None,
    int_high: Optional[int] = None,
    input_factory: Optional[Callable[[], Any]] = None,
    randomness: str = "error",
    train: bool = False,
    settings: Optional[RunSettings] = None,
    verbose: bool = True,
    **options: Any,
) -> BenchmarkResult:
    """Benchmark N copies of `model_class(**model_kwargs)` made wide two ways: `vmap` (torch.func over
    the whole model) and `surgery` (each layer an op fuses swapped for its wide module).

    `model_class` is an nn.Module class or any function returning a new model (`make_layer`,
    `timm.create_model` with functools.partial); a transformers layer takes its config as
    `model_kwargs={'config': LlamaConfig(...)}`.

    `input_shape` is the shape of one model's input, or a list of shapes for a module of
    several inputs; each of the N models gets its own. `input_dtype` is 'float' (the run's
    dtype; the default), 'int64', 'int32' or 'bool', one for all inputs or a list of one per
    input; integer inputs are drawn from [0, int_high). Or `input_factory()` (with
    input_shape=None) returns one model's input: a tensor, a tuple of positional arguments or a dict
    of keyword arguments (a tensor that is the same object for every model is passed once).
    `randomness` is vmap's ('error', 'different', 'same') for models that draw random
    numbers; `train` runs the models in train mode (dropout active) in the inference mode too
    (the training modes always do). `name` defaults to the model's class's name. The run's
    settings are `settings` (a RunSettings) or, for short, keywords among `options`, as
    `benchmark`'s; the model's own arguments go in `model_kwargs`.
    """
    given, other = RunSettings.split(options)
    if other:
        first = next(iter(other))
        raise WideTesseraError(
            f"benchmark_custom: {first}={other[first]!r} is not a run setting (valid: "
            f"{', '.join(RunSettings.names())}); "
            f"give the model's own arguments as model_kwargs={other!r}"
        )
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise WideTesseraError(f"model_kwargs={model_kwargs!r}: give a dict of the model's keyword arguments")
    preset = given.pop("preset", None)
    settings = _run_settings(settings, given, preset, "custom")
    if settings.preset != "custom":  # a preset is an op's sweep: a custom run's N values are n_values
        raise WideTesseraError(
            f"benchmark_custom: preset={settings.preset!r}: a custom run takes no op's preset (valid: None or "
            "'custom'); it sweeps n_values (given), and how long it samples is timing=TimingConfig(budget_s=...)"
        )
    job = build_custom_job(
        model_class,
        input_shape,
        n_values,
        name,
        dtype,
        dict(model_kwargs or {}),
        settings,
        input_dtype=input_dtype,
        int_high=int_high,
        input_factory=input_factory,
        randomness=randomness,
        train=train or settings.mode in TRAINING_MODES,
    )
    return run(job, settings, verbose=verbose)


def build_custom_job(
    model_class: Callable[..., nn.Module],
    input_shape: Any,
    n_values: Sequence[int],
    name: Optional[str],
    dtype: Any,
    model_kwargs: Dict[str, Any],
    settings: RunSettings,
    **inputs: Any,
) -> BenchmarkJob:
    """The job behind benchmark_custom (and the `custom` command); `inputs` are custom_job's input options.

    The module is tried on one input first, under `isolate` in a worker process within the
    setup stage's time limit, so a module that crashes or hangs cannot take the caller with it.
    """
    limit = settings.timeouts.limit("setup")
    what = f"trying {factory_name(model_class)} on one input"
    run_check = partial(call_isolated, limit_s=limit, what=what) if settings.isolate else (lambda check: check())
    return custom_job(model_class, input_shape, n_values, name, dtype, model_kwargs, run_check, **inputs)


def measure(fn: Callable[[], object], device: str = "cpu", config: Optional[TimingConfig] = None) -> TimingStats:
    """Time `fn()` on `device` (see `wide_tessera.measurement.timing.measure`), after checking the arguments."""
    if not callable(fn):
        raise WideTesseraError(f"measure: fn={fn!r} is not callable; give a function of no arguments")
    check_instance("config", config, TimingConfig)
    return timing.measure(fn, resolve_device(device), config)
