"""What the measuring commands share: their options, declared once as groups, and the parsers
that turn typed text into values (each refusing bad text with one line that names it).

A run setting's help text is RunSettings' own (measurement.settings); an option here only
names the flag.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import click

from ..core.errors import WideTesseraError, one_line, unknown
from ..core.stats import REGRET
from ..core.user_input import MAX_THREADS, check_number
from ..measurement.controls import COMPILE_MODES
from ..measurement.modes import MODES
from ..measurement.settings import (
    CONFIRM_MODES,
    CONTROLS_AT,
    PRESET_RUNS,
    RunSettings,
    default_timing,
    resolve_device,
)
from ..measurement.stages import StageTimeouts
from ..measurement.timing import CLOCKS, TimingConfig
from ..ops.registry import import_ops

__all__ = [
    "usage_errors",
    "options",
    "IMPORT",
    "DEVICE",
    "QUIET",
    "NO_SAVE",
    "SELECTION",
    "SAMPLING",
    "RUN_OPTIONS",
    "parse_override",
    "override_texts",
    "parse_size",
    "parse_shape",
    "parse_kwarg",
    "model_kwargs",
    "load_object",
    "choices",
    "check_directory",
    "settings_from",
]


@contextmanager
def usage_errors() -> Iterator[None]:
    """A WideTesseraError inside becomes click's usage error: one line, exit status 2."""
    try:
        yield
    except WideTesseraError as e:
        raise click.UsageError(" ".join(str(e).split())) from None


def options(*decorators: Callable) -> Callable:
    """Apply click options in the order listed (click's decorators apply bottom-up)."""

    def decorate(f: Callable) -> Callable:
        for option in reversed(decorators):
            f = option(f)
        return f

    return decorate


def _option(name: str, *decls: str, **kwargs: Any) -> Callable:
    """A click option for the RunSettings field `name`, with the field's own help."""
    meta = {f.name: f.metadata for f in dataclasses.fields(RunSettings)}[name]
    return click.option(*decls, help=meta["help"], **kwargs)


IMPORT = click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="Import MODULE first: its @register ops and register_strategy strategies join the run (repeatable).",
)
DEVICE = _option("device", "--device", default=None)
QUIET = click.option("--quiet", is_flag=True, help="No progress on stderr.")
NO_SAVE = click.option(
    "--no-save",
    is_flag=True,
    help="Do not keep the run in the runs folder (.wide_tessera/runs, or $WIDE_TESSERA_RUNS).",
)

# What to measure: the N values, other axes, the seed, the threads.
SELECTION = options(
    click.option("--n-values", default=None, metavar="N1,N2,...", help="Replace the preset's N values."),
    click.option("--set", "sets", multiple=True, metavar="AXIS=V1,V2", help="Replace a sweep axis (repeatable)."),
    _option("seed", "--seed", default=0, show_default=True),
    click.option(
        "--threads",
        default=None,
        metavar="K|auto",
        callback=lambda ctx, param, value: _threads(value),
        help="CPU threads for torch; auto: the cores other processes leave free  [default: torch's choice]",
    ),
    _option("search", "--search", default=None, metavar="LO:HI"),
)

# How every measuring command samples and guards its points.
SAMPLING = options(
    click.option(
        "--budget",
        type=float,
        default=None,
        help="At most this many seconds of sampling per function (a point stops sooner once its decision is "
        f"made).  [default: {TimingConfig.budget_s}; preset quick: "
        f"{PRESET_RUNS['quick'].budget_s}, ci: {PRESET_RUNS['ci'].budget_s}]",
    ),
    click.option("--cuda-graph", is_flag=True, help="CUDA only: time CUDA-graph replays, without launch overhead."),
    click.option(
        "--clock",
        type=click.Choice(CLOCKS),
        default="auto",
        show_default=True,
        help="CPU only: auto times one torch thread by its CPU clock, which other processes' load does not "
        "stretch, and more threads by wall time; wall: always wall time.",
    ),
    _option("isolate", "--isolate", is_flag=True),
    click.option(
        "--timeout-multiplier", type=float, default=1.0, show_default=True, help="Scale every stage's time limit."
    ),
    _option("memory_budget", "--memory-budget", default=None, metavar="SIZE"),
    _option("mode", "--mode", type=click.Choice(MODES), default="inference", show_default=True),
    _option(
        "compile", "--compile", "compile_mode", type=click.Choice(COMPILE_MODES), default="none", show_default=True
    ),
)

# The options of `benchmark` and `custom`: everything a run can be asked.
RUN_OPTIONS = options(
    IMPORT,
    DEVICE,
    click.option("-o", "--output", default=None, help="Write every result to this JSON file, after every point."),
    click.option(
        "--resume", is_flag=True, help="Continue the incomplete results in -o FILE, skipping measured points."
    ),
    click.option(
        "--overwrite", is_flag=True, help="Replace the results -o FILE holds (without it, such a file is refused)."
    ),
    NO_SAVE,
    SELECTION,
    click.option(
        "--target-ci",
        type=float,
        default=TimingConfig.target_rel_ci,
        show_default=True,
        help="With --precise: sample until each median's 95% CI is narrower than this fraction of it. "
        "(Without it, sampling stops when the decision is made, and this is not used.)",
    ),
    SAMPLING,
    _option("confirm", "--confirm", type=click.Choice(CONFIRM_MODES), default=None),
    _option("controls", "--controls/--no-controls", default=None),
    _option("controls_at", "--controls-at", type=click.Choice(CONTROLS_AT), default="largest", show_default=True),
    _option("precise", "--precise", is_flag=True),
    _option("regret", "--regret", type=float, default=REGRET, show_default=True),
    _option("roofline", "--roofline", is_flag=True),
    _option("energy", "--energy", is_flag=True),
    _option("trace", "--trace", default=None, metavar="DIR"),
    _option("trace_n", "--trace-n", default=None, metavar="N1,N2,..."),
    click.option(
        "--dump-ir",
        default=None,
        metavar="DIR",
        help="After the run, write each Triton kernel's TTIR, TTGIR, LLIR, PTX and facts (compile times, registers, "
        "autotuning) to DIR.",
    ),
    click.option(
        "--strict", is_flag=True, help="Exit 3 when a result is UNRELIABLE (busy machine, unstable points...)."
    ),
    QUIET,
    click.option(
        "--save-dispatch",
        default=None,
        metavar="TABLE",
        help="Merge each op's verdicts into this dispatch table (see `tune`); only confirmed wins enter it as fuse.",
    ),
)


def parse_override(text: str) -> Tuple[str, List[str]]:
    """'channels=32,64' -> ('channels', ['32', '64']); the op's sweep reads each value as its axis's kind."""
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise WideTesseraError(f"--set {text!r}: expected AXIS=V1,V2,... (e.g. channels=32,64)")
    return key.strip(), values.split(",")


def override_texts(sets: Tuple[str, ...], n_values: Optional[str]) -> Dict[str, List[str]]:
    """--set and --n-values as text by axis; an axis given twice would silently lose one of them."""
    texts: Dict[str, List[str]] = {}
    for key, values in map(parse_override, sets):
        if key == "n_values":
            raise WideTesseraError(f"--set n_values=...: give N values with --n-values {','.join(values)}")
        if key in texts:
            raise WideTesseraError(f"--set {key} is given twice; give all its values in one: --set {key}=V1,V2")
        texts[key] = values
    if n_values is not None:
        texts["n_values"] = n_values.split(",")
    return texts


_SIZE_UNITS = {"": 1, "b": 1, **{f"{u}{s}": 2 ** (10 * (i + 1)) for i, u in enumerate("kmg") for s in ("", "b", "ib")}}


def parse_size(text: str, option: str = "--memory-budget") -> int:
    """'512MiB', '2GB', '1.5g', '1048576' -> bytes (K, M, G are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise WideTesseraError(f"{option} {text!r}: expected a size of at least one byte, such as 512MiB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_shape(text: str) -> Tuple[int, ...]:
    """'32,256' -> (32, 256); the sizes are checked with the job's (widen.custom)."""
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise WideTesseraError(
            f"--input-shape {text!r}: expected positive ints separated by commas, e.g. 32,256"
        ) from None


def parse_kwarg(text: str, option: str = "--kwarg") -> Tuple[str, Any]:
    """'d=256' -> ('d', 256): a Python literal where the value reads as one (256, 0.1, True, (3, 3)), else the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise WideTesseraError(f"{option} {text!r}: expected NAME=VALUE, e.g. hidden=512")
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value
    except (MemoryError, RecursionError):  # Python's parser gives up on a literal nested thousands deep
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise WideTesseraError(
            f"{option} {key.strip()}={shown}: nested too deeply to read as a Python literal; give a flatter value"
        ) from None


def parse_kwargs(texts: Sequence[str], option: str = "--kwarg") -> Dict[str, Any]:
    """Every --kwarg, each name once: a name given twice would silently lose one value."""
    kwargs: Dict[str, Any] = {}
    for key, value in (parse_kwarg(text, option) for text in texts):
        if key in kwargs:
            raise WideTesseraError(f"{option} {key} is given twice ({kwargs[key]!r} and {value!r}); give it once")
        kwargs[key] = value
    return kwargs


def model_kwargs(kwargs: Sequence[str], config: Optional[str], config_kwargs: Sequence[str]) -> Dict[str, Any]:
    """The model's arguments: every --kwarg, and `config=` built from --config MODULE:CLASS and its
    --config-kwarg, as a transformers layer takes it (`LlamaDecoderLayer(config, ...)`)."""
    given = parse_kwargs(kwargs)
    if config is None:
        if config_kwargs:
            raise WideTesseraError("--config-kwarg is an argument of --config's class: give --config MODULE:CLASS too")
        return given
    if "config" in given:
        raise WideTesseraError("give the model's config by --config MODULE:CLASS or by --kwarg config=..., not both")
    config_class = load_object(config, "--config", "a config class")
    arguments = parse_kwargs(config_kwargs, "--config-kwarg")
    try:
        built = config_class(**arguments)
    except Exception as e:  # noqa: BLE001  the config class's own error, in one line
        raise WideTesseraError(f"--config {config}: cannot build it from {arguments!r}: {one_line(e)}") from None
    return {**given, "config": built}


def load_object(spec: str, option: str, what: str) -> Any:
    """'my_pkg.models:Expert' -> the object, imported (from the current directory too)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise WideTesseraError(f"{option} {spec!r}: expected MODULE:NAME, e.g. my_pkg.models:Expert")
    import_ops([module])
    obj = sys.modules[module]
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise WideTesseraError(f"{option} {spec!r}: {module} has no {attr!r} ({what})") from None
        except Exception as e:  # noqa: BLE001  the module's own __getattr__ failed: its error, in one line
            raise WideTesseraError(f"{option} {spec!r}: reading {part!r} of it raised {one_line(e)}") from None
    return obj


def parse_ns(text: str, option: str) -> List[int]:
    """'1,4,16' -> [1, 4, 16]."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise WideTesseraError(f"{option} {text!r}: expected N values such as 1,4,16") from None


def parse_search(text: str) -> List[int]:
    """'1:4096' -> [1, 4096] (the settings check that they are powers of two, in order)."""
    lo, _, hi = text.partition(":")
    try:
        return [int(lo), int(hi)]
    except ValueError:
        raise WideTesseraError(f"--search {text!r}: expected LO:HI, powers of two such as 1:4096") from None


def choices(text: str, kind: str, valid: Sequence[str]) -> List[str]:
    """'a, b' -> ['a', 'b'], each one of `valid`."""
    chosen = [value.strip() for value in text.split(",")]
    for value in chosen:
        if value not in valid:
            raise unknown(kind, value, valid)
    return chosen


def check_directory(path: str, option: str = "-o") -> None:
    """A folder the run can make and write, checked without making it: the run writes there
    only later (a trace once its point is measured), and a refusal then would be lost output."""
    if not path:
        raise WideTesseraError(f"{option} '': give a folder name")
    if Path(path).exists() and not Path(path).is_dir():
        raise WideTesseraError(f"{option} {path}: exists and is not a directory; give a directory")
    nearest = next(folder for folder in [Path(path), *Path(path).parents] if folder.exists())
    if not nearest.is_dir():
        raise WideTesseraError(f"{option} {path}: cannot write there: {nearest} is not a directory")
    if not os.access(nearest, os.W_OK):
        raise WideTesseraError(f"{option} {path}: cannot write there: {nearest} is not writable")


# Names in the settings' own errors -> the options that set them, where they differ.
_OPTIONS = {
    "budget_s": "--budget",
    "target_rel_ci": "--target-ci",
    "multiplier": "--timeout-multiplier",
    "threads": "--threads",
}


def _threads(value: Optional[str]) -> Union[None, int, str]:
    """--threads K (checked with the run's settings) or auto."""
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: give a number of threads, or auto") from None


def settings_from(
    preset: str,
    *,
    device: Optional[str],
    seed: int,
    threads: Optional[int],
    target_ci: float = TimingConfig.target_rel_ci,
    budget: Optional[float],
    cuda_graph: bool,
    timeout_multiplier: float,
    clock: str = "auto",
    memory_budget: Optional[str],
    search: Optional[str] = None,
    trace_n: Optional[str] = None,
    **settings: Any,
) -> RunSettings:
    """The run's settings from the options (the simple ones by their RunSettings names), each
    checked; an error names the option, not the field."""
    settings["compile"] = settings.pop("compile_mode", "none")
    resolved = resolve_device(device)
    if cuda_graph and not resolved.startswith("cuda"):
        raise WideTesseraError(f"--cuda-graph needs a CUDA device; the run is on {resolved}")
    try:
        if threads is not None:
            check_number("threads", threads, 1, MAX_THREADS, integer=True, low_ok=True)
        return RunSettings(
            preset=preset,
            device=resolved,
            seed=seed,
            timing=TimingConfig(
                target_rel_ci=target_ci,
                budget_s=default_timing(preset).budget_s if budget is None else budget,
                cuda_graph=cuda_graph,
                clock=clock,
            ),
            timeouts=StageTimeouts(multiplier=timeout_multiplier),
            memory_budget=None if memory_budget is None else parse_size(memory_budget),
            search=None if search is None else parse_search(search),
            trace_n=None if trace_n is None else parse_ns(trace_n, "--trace-n"),
            **settings,
        )
    except WideTesseraError as e:
        field, sep, rest = str(e).partition("=")
        option = _OPTIONS.get(field) or RunSettings.option_of(field)
        raise WideTesseraError(f"{option} {rest}" if sep and option else str(e)) from None
