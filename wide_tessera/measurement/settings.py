"""How a job's points are measured: one settings object, and the presets' defaults.

`RunSettings` travels whole from the API and the command line to the runner, the isolated
worker, the result file and `--resume`'s check. Each field declares, once, what the command
line says of it (`help`, its `option`) and whether `--resume` refuses to continue a file
measured with another value (`resume`): a new setting is added here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from dataclasses_json import dataclass_json

from ..core.errors import WideTesseraError, unknown
from ..core.job import MAX_N
from ..core.stats import REGRET
from ..core.user_input import check_bool, check_instance, check_number, check_seed
from .controls import COMPILE_MODES
from .modes import check_mode
from .stages import StageTimeouts
from .timing import TimingConfig

__all__ = [
    "RunSettings",
    "CONFIRM_MODES",
    "PRESET_RUNS",
    "PresetRun",
    "preset_run",
    "default_timing",
    "default_controls",
    "resolve_device",
    "device_named",
    "check_search",
    "CONTROLS_AT",
]

CONFIRM_MODES = ("deciding", "all", "none")
CONTROLS_AT = ("largest", "every")


@dataclass(frozen=True)
class PresetRun:
    """How a run of a preset samples, confirms and controls where its caller does not say."""

    budget_s: float = TimingConfig.budget_s
    confirm: str = "deciding"
    # the device types on which the controls are timed unless the caller says
    controls: Tuple[str, ...] = ("cpu", "cuda")


# The `ci` preset is a smoke run of every op: does each strategy run and compute what the N
# calls compute, with a rough speedup. With the full settings all 17 ops took 370 s on the
# 2-core CPU (controls compiled at every point, deciding points measured twice, 0.5 s per
# function); with these, 59 s. Its verdicts keep their intervals, its header says they are
# unconfirmed, and any of the three can be asked back (--budget, --confirm, --controls).
# `quick`, the README's first command, keeps confirmation with 0.25 s per function as the
# cap, not the aim: sampling stops where the decisions settle. Its 121 CPU points took 512 s
# when they sampled to 2% medians; with the decision rule the whole run took 2 min 27 s
# (2026-11-24, `wide_tessera benchmark --all --preset quick`, 2-core CPU, quiet), confirmation
# included. It times the controls on a GPU, where "fuse, or capture the loop in a CUDA
# graph?" is the question; on a CPU, where no graph captures anything, the compiled loop
# was 40% of a first run: every op compiled it afresh with an empty inductor cache (conv2d
# 25.6 s with it, 10.8 s without; 2026-11-25, 2-core CPU). --controls asks for them there.
PRESET_RUNS = {"ci": PresetRun(budget_s=0.1, confirm="none", controls=()), "quick": PresetRun(0.25, controls=("cuda",))}


def preset_run(preset: Optional[str]) -> PresetRun:
    return PRESET_RUNS.get(preset or "", PresetRun())


def default_timing(preset: Optional[str] = None) -> TimingConfig:
    """The timing settings of a run that names none: its preset's budget, the other defaults."""
    return TimingConfig(budget_s=preset_run(preset).budget_s)


def default_controls(preset: Optional[str] = None, device: str = "cpu") -> bool:
    """Whether a run on `device` that does not say times the controls: where its preset times them."""
    return torch.device(device).type in preset_run(preset).controls


def device_named(device: Any) -> torch.device:
    """The device `device` names (cpu, cuda, cuda:N), whether or not this machine has it: a file
    measured on a GPU still loads on a CPU. Anything else is one line."""
    try:
        d = torch.device(device) if isinstance(device, (str, torch.device)) else None
    except (RuntimeError, TypeError):
        d = None
    # torch accepts 'cpu:1', but there is one CPU device: an index there is a typo.
    if d is None or d.type not in ("cpu", "cuda") or (d.type == "cpu" and d.index is not None):
        raise WideTesseraError(f"unknown device {device!r} (valid: cpu, cuda, cuda:N)")
    return d


def resolve_device(device: Any) -> str:
    """None means CUDA when available, else CPU; anything else must exist on this machine."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    d = device_named(device)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise WideTesseraError(f"device {device!r}: CUDA is not available on this machine (valid here: cpu)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise WideTesseraError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return str(d)


def check_search(search: Any) -> Tuple[int, int]:
    """(lo, hi) of a crossover search: powers of two, lo < hi, within what this tool builds."""
    ok = isinstance(search, (list, tuple)) and len(search) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_N for v in search)
    if not ok or search[0] >= search[1] or any(v & (v - 1) for v in search):
        raise WideTesseraError(
            f"search={search!r}: give (LO, HI), powers of two with 1 <= LO < HI <= {MAX_N} "
            "(e.g. (1, 4096); --search 1:4096)"
        )
    return search[0], search[1]


def _field(default: Any, help: str, *, option: Optional[str] = None, resume: bool = False, factory: Any = None) -> Any:
    """A field of RunSettings: `help` and `option` as the command line shows them; `resume`:
    --resume refuses a file measured with another value (it changes what a measurement means)."""
    metadata = {"help": help, "option": option, "resume": resume}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass_json
@dataclass(frozen=True)
class RunSettings:
    """How to run a job's points (see the module's docstring); timing, confirm and controls given
    as None are the preset's (PRESET_RUNS), else the defaults; device None is CUDA when available.
    __post_init__ fills every one of them, but their types stay Optional: results files of
    earlier schemas hold None there, and decoding checks the types."""

    preset: Optional[str] = _field(None, "Sweep preset: ci, quick or full.", option="--preset", resume=True)
    device: Optional[str] = _field(
        None, "cpu, cuda or cuda:N  [default: cuda if available, else cpu]", option="--device"
    )
    seed: int = _field(0, "Seed for models and inputs.", option="--seed", resume=True)
    mode: str = _field(
        "inference",
        "What is timed: inference (no autograd), forward (recording), backward, forward_backward, train_step "
        "(forward, backward, one SGD step), train (a sweep's step: forward, backward, each model clipped, stepped by "
        "AdamW with its own settings, scheduled). Training modes also check gradients and updated parameters; "
        "train, each model after 10 steps against its separate training.",
        option="--mode",
        resume=True,
    )
    compile: str = _field(
        "none",
        "torch.compile the baseline and every strategy alike; the compiled callables are checked and timed.",
        option="--compile",
        resume=True,
    )
    energy: bool = _field(
        False,
        "Also measure each callable's energy per call and power from NVML's counter (CUDA): "
        "3 windows of at least 1 s each, per callable and point.",
        option="--energy",
        resume=True,
    )
    timing: Optional[TimingConfig] = _field(None, "When sampling stops (TimingConfig).", resume=True)
    regret: Optional[float] = _field(
        REGRET,
        "Stop sampling a point once the worst a wrong choice can cost beyond the 5% margin is at most this "
        "fraction: fusing, if the speedup is its interval's bottom; the loop, if it is the top. None in files "
        "from before it (their decisions had a marginal zone instead).",
        option="--regret",
        resume=True,
    )
    timeouts: StageTimeouts = _field(None, "Each stage's time limit (StageTimeouts).", factory=StageTimeouts)
    memory_budget: Optional[int] = _field(
        None, "Skip points estimated above SIZE (e.g. 4GiB).", option="--memory-budget"
    )
    isolate: bool = _field(
        False, "Run each op in a worker process: a hang or crash costs one strategy.", option="--isolate"
    )
    confirm: Optional[str] = _field(
        None,
        "Which points to measure again, independently, after the sweep; disagreeing points are unstable.  "
        "[default: deciding; preset ci: none]",
        option="--confirm",
    )
    controls: Optional[bool] = _field(
        None,
        "Also time the baseline loop in one CUDA graph (CUDA) and compiled, and in train_step and train stepped by "
        "one foreach or fused optimizer: cheaper loops that do not fuse.  "
        "[default: controls; preset ci: no-controls; preset quick: on a GPU only]",
        option="--controls",
    )
    roofline: bool = _field(
        False, "Measure the device's peaks (cached) and show timings against the roofline bound.", option="--roofline"
    )
    precise: bool = _field(
        False,
        "Sample until every median is known within --target-ci (or the budget is spent), not just until the "
        "point's decision is made: precise times, at several times the cost.",
        option="--precise",
        resume=True,
    )
    controls_at: str = _field(
        "largest",
        "Where the controls are timed: at each parameter group's largest N, where their answer (fuse or "
        "capture?) is given, or at every point.",
        option="--controls-at",
    )
    trace: Optional[str] = _field(
        None,
        "Write a torch.profiler trace (Chrome/Perfetto JSON) of a few calls of each callable at each point to "
        "DIR, after its timings; on CUDA every timed sample is also an NVTX range of the same name.",
        option="--trace",
    )
    trace_n: Optional[List[int]] = _field(
        None, "Trace only the points of these N values (with --trace).", option="--trace-n"
    )
    search: Optional[List[int]] = _field(
        None,
        "Find each group's crossover by bisection over the powers of two from LO to HI, instead of "
        "measuring every N (LO:HI; replaces --n-values).",
        option="--search",
    )

    def __post_init__(self) -> None:
        def fill(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.device is None:  # a given device is resolved where it is given (RunSettings.of): a file
            fill("device", resolve_device(None))  # measured on a GPU still loads on a CPU
        device_named(self.device)
        if self.preset is not None and not isinstance(self.preset, str):
            raise WideTesseraError(f"preset={self.preset!r}: give a preset's name")
        check_mode(self.mode)
        if self.timing is None:
            fill("timing", default_timing(self.preset))
        if self.controls is None:
            fill("controls", default_controls(self.preset, self.device))
        if self.confirm is None:
            fill("confirm", preset_run(self.preset).confirm)
        check_seed(self.seed)
        for name in ("controls", "roofline", "energy", "isolate"):
            check_bool(name, getattr(self, name))
        if self.compile not in COMPILE_MODES:
            raise unknown("compile mode", self.compile, COMPILE_MODES)
        if self.confirm not in CONFIRM_MODES:
            raise unknown("confirm", self.confirm, CONFIRM_MODES)
        check_instance("timing", self.timing, TimingConfig)
        check_instance("timeouts", self.timeouts, StageTimeouts)
        check_bool("precise", self.precise)
        if self.regret is not None:
            check_number("regret", self.regret, 0, 1, what="a fraction (0.02: 2%)", low_ok=True)
        if self.controls_at not in CONTROLS_AT:
            raise unknown("controls_at", self.controls_at, CONTROLS_AT)
        if self.controls_at == "every" and not self.controls:
            raise WideTesseraError(
                "controls_at='every': this run times no controls (controls=False); time them (--controls) or leave "
                "--controls-at out"
            )
        if self.search is not None:
            check_search(self.search)
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise WideTesseraError(f"trace={self.trace!r}: give the path of a folder for the traces")
        if self.trace_n is not None and (
            not isinstance(self.trace_n, list) or not all(isinstance(n, int) and n > 0 for n in self.trace_n)
        ):
            raise WideTesseraError(f"trace_n={self.trace_n!r}: give a list of N values (positive integers)")
        if self.trace_n is not None and self.trace is None:
            raise WideTesseraError(
                f"trace_n={self.trace_n!r}: traces are written only where trace (--trace) names a folder"
            )
        if self.memory_budget is not None:
            check_number("memory_budget", self.memory_budget, 0, 2**60, integer=True, what="a number of bytes")

    @classmethod
    def of(cls, **options: Any) -> "RunSettings":
        """The settings a caller asks for, its device checked against this machine. regret None is
        a file's, from before regret bounds: a run is decided by one."""
        if "regret" in options and options["regret"] is None:
            check_number("regret", None, 0, 1, what="a fraction (0.02: 2%)", low_ok=True)
        return cls(**{**options, "device": resolve_device(options.get("device"))})

    @classmethod
    def names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def split(cls, options: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """`options` as (the settings among them, the rest): how the API tells a run's settings
        from an op's sweep axes or a model's arguments."""
        names = set(cls.names())
        return {k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names}

    def resumable_as(self) -> List[Tuple[str, Any]]:
        """(name, value) of every setting that --resume requires to be the file's own."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.metadata["resume"]]

    @staticmethod
    def describe(name: str, value: Any, other: Any) -> str:
        """How --resume names a setting's value: 'seed 7', 'no --energy', 'timing budget_s=0.25'
        (only the timing fields that differ from `other`)."""
        if dataclasses.is_dataclass(value) and type(other) is type(value):
            fields = [f.name for f in dataclasses.fields(value) if getattr(value, f.name) != getattr(other, f.name)]
            return f"{name} " + ", ".join(f"{f}={getattr(value, f)}" for f in fields)
        meta = {f.name: f.metadata for f in dataclasses.fields(RunSettings)}.get(name)
        if isinstance(value, bool) and meta and meta["option"]:
            return meta["option"] if value else f"no {meta['option']}"
        return f"{'compile mode' if name == 'compile' else name} {value}"

    @staticmethod
    def option_of(name: str) -> Optional[str]:
        meta = {f.name: f.metadata for f in dataclasses.fields(RunSettings)}.get(name)
        return meta["option"] if meta else None
