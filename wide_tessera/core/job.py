"""What to benchmark: the sweep of N values and parameter axes, and the op's factories."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from dataclasses_json import dataclass_json

from .errors import WideTesseraError, unknown

__all__ = [
    "DTYPES",
    "MAX_N",
    "SweepParams",
    "Work",
    "BenchmarkJob",
    "params_text",
    "point_key",
    "point_keys",
    "group_key",
]

DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# More copies than any fused layer we know of; larger is a typo that would build
# millions of models before failing.
MAX_N = 4096


@dataclass(frozen=True)
class SweepParams:
    """The N values to try and, per parameter axis, the values to combine.

    `dtype` is an axis like any other; its values are names from `DTYPES`.
    """

    n_values: Tuple[int, ...]
    axes: Dict[str, Tuple[Any, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, n_values: Sequence[int], **axes: Sequence[Any]) -> "SweepParams":
        return cls(tuple(n_values), {k: tuple(v) for k, v in axes.items()})

    def param_grid(self) -> Iterator[Dict[str, Any]]:
        """Every combination of axis values, in axis order, N excluded."""
        names = list(self.axes)
        for values in itertools.product(*(self.axes[k] for k in names)):
            yield dict(zip(names, values))

    def points(self) -> List[Tuple[int, Dict[str, Any]]]:
        """Every (N, params) of the sweep in run order: each parameter group's N values together."""
        return [(n, params) for params in self.param_grid() for n in self.n_values]

    def n_points(self) -> int:
        return len(self.n_values) * len(list(self.param_grid()))

    def with_overrides(self, **overrides: Any) -> "SweepParams":
        """A copy with some axes' values replaced; each value is checked against the axis."""
        n_values = self.n_values
        axes = dict(self.axes)
        for key, value in overrides.items():
            if key == "n_values":
                n_values = _check_values(key, value, kind="n")
            elif key in axes:
                axes[key] = _check_values(key, value, kind=_axis_kind(key, axes[key]))
            else:
                raise unknown("sweep axis", key, ["n_values", *axes])
        return SweepParams(n_values, axes)

    def parse_overrides(self, texts: Dict[str, Sequence[str]]) -> Dict[str, List[Any]]:
        """Overrides typed on a command line, each value read as its axis's kind.

        '0.25' is a float on a float axis and stays the string '0.25' on a string axis. Text
        that does not read as the kind is passed on as it is, for `with_overrides` to reject
        with its usual message.
        """
        parsed = {}
        for key, values in texts.items():
            if key != "n_values" and key not in self.axes:
                raise unknown("sweep axis", key, ["n_values", *self.axes])
            kind = "n" if key == "n_values" else _axis_kind(key, self.axes[key])
            parsed[key] = [_parse_text(v.strip(), kind) for v in values]
        return parsed


def _parse_text(text: str, kind: str) -> Any:
    if kind == "bool" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    for number, kinds in ((int, ("n", "int")), (float, ("float",))):
        if kind in kinds:
            try:
                return number(text)
            except ValueError:
                return text
    return text


def _axis_kind(name: str, values: Tuple[Any, ...]) -> str:
    if name == "dtype":
        return "dtype"
    if all(isinstance(v, bool) for v in values):
        return "bool"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "int"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return "float"
    return "any"


def _check_values(name: str, value: Any, kind: str) -> Tuple[Any, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not values:
        raise WideTesseraError(f"{name}: empty list; give at least one value")
    for v in values:
        if not (v is None or isinstance(v, (str, int, float))):  # results files and point keys hold single values
            raise WideTesseraError(f"{name}: a {type(v).__name__} is not a single value")
        if kind in ("n", "int") and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise WideTesseraError(f"{name}: {v!r} is not a positive integer")
        if kind == "n" and isinstance(v, int) and v > MAX_N:
            raise WideTesseraError(f"{name}: {v} is more than {MAX_N}, the most copies this tool builds")
        if kind == "float" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise WideTesseraError(f"{name}: {v!r} is not a finite number")
        if kind == "bool" and not isinstance(v, bool):
            raise WideTesseraError(f"{name}: {v!r} is not True or False")
        if kind == "dtype" and v not in DTYPES:
            raise unknown("dtype", v, DTYPES)
    if len(set(values)) != len(values):
        raise WideTesseraError(f"{name}: {list(values)} repeats a value")
    return values


@dataclass_json
@dataclass(frozen=True)
class Work:
    """What one call must do: floating-point operations, and the fewest bytes it can move
    (every input read once, every output written once)."""

    flops: float
    min_bytes: float


@dataclass
class BenchmarkJob:
    """Everything the runner needs; the op class fills it in `benchmark_job`.

    model_factory(**params) -> one nn.Module (fp32, CPU; the runner moves it)
    input_factory(n, **params) -> n inputs, one per model (CPU): a tensor, or a tuple of
        tensors passed as positional arguments; floating-point tensors are cast to the
        point's dtype, integer ones (token ids) are kept
    wide_factory(modules, strategy) -> the wide nn.Module, with `pack(inputs)`
        and `unpack(output)` for its own input and output layout
    train: the models run in train mode (dropout active, batch-norm on batch statistics),
        still without autograd
    seeded_check_factory: for models that draw random numbers, None for the rest. Their
        outputs compare only when both sides draw the same numbers, so every checked call
        starts from the same generator state, and the strategy is checked through
        `seeded_check_factory(modules, strategy)`: its wide module drawing once for all N
        models (vmap's randomness='same'), which is what each model's own call, started
        from that state, draws. The module built by `wide_factory` is the one timed.
    strategy_needs: strategy -> capabilities.Needs; the runner skips, with the reason,
        a strategy the run cannot give what it needs
    unfit_factory(n, **params): why N models cannot run at these parameters, or None; the
        runner skips such a point with the reason (hf_experts: a top_k above N)
    """

    op: str
    preset: str
    strategies: List[str]
    sweep: SweepParams
    model_factory: Callable[..., torch.nn.Module]
    input_factory: Callable[..., List[Any]]
    wide_factory: Callable[[List[torch.nn.Module], str], torch.nn.Module]
    # strategy -> what it needs from the run (capabilities.Needs); a strategy not named needs nothing
    strategy_needs: Dict[str, Any] = field(default_factory=dict)
    # work_factory(n, **params) -> Work of one call of the N models, or None
    work_factory: Callable[..., Any] = field(default_factory=lambda: unknown_work)
    train: bool = False
    seeded_check_factory: Optional[Callable[[List[torch.nn.Module], str], torch.nn.Module]] = None
    unfit_factory: Callable[..., Optional[str]] = field(default_factory=lambda: fits_any_n)

    @property
    def random(self) -> bool:
        """Whether the models draw random numbers (see seeded_check_factory)."""
        return self.seeded_check_factory is not None


def unknown_work(n: int, **params: Any) -> None:
    """The work_factory of a job whose op does not say what one call must do (a module-level
    function, not a lambda: an isolated run pickles the job)."""
    return None


def fits_any_n(n: int, **params: Any) -> None:
    """The unfit_factory of a job whose op runs at any N (module level, as unknown_work)."""
    return None


def point_key(n: int, params: Dict[str, Any]) -> str:
    """A point's identity across runs and passes (--resume, the confirmation pass, compare, shards)."""
    return json.dumps([n, params], sort_keys=True)


def group_key(params: Dict[str, Any]) -> str:
    """A parameter group's identity: its parameters, every one but N."""
    return json.dumps(params, sort_keys=True)


def point_keys(points: Sequence[Any]) -> Set[str]:
    """The keys of points (anything with `n` and `params`: PointResult)."""
    return {point_key(p.n, p.params) for p in points}


def params_text(params: Dict[str, Any]) -> str:
    """'batch=8 channels=64 dtype=float32': how summaries and progress lines name a point's parameters."""
    return " ".join(f"{k}={v}" for k, v in params.items())
