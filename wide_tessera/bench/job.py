"""What to benchmark: the sweep of N values and parameter axes, and the op's factories."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from ..errors import WideTesseraError, unknown

__all__ = ["DTYPES", "SweepParams", "BenchmarkJob", "params_text"]

DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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


def _axis_kind(name: str, values: Tuple[Any, ...]) -> str:
    if name == "dtype":
        return "dtype"
    if all(isinstance(v, bool) for v in values):
        return "bool"
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "int"
    return "any"


def _check_values(name: str, value: Any, kind: str) -> Tuple[Any, ...]:
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not values:
        raise WideTesseraError(f"{name}: empty list; give at least one value")
    for v in values:
        if kind in ("n", "int") and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise WideTesseraError(f"{name}: {v!r} is not a positive integer")
        if kind == "bool" and not isinstance(v, bool):
            raise WideTesseraError(f"{name}: {v!r} is not True or False")
        if kind == "dtype" and v not in DTYPES:
            raise unknown("dtype", v, DTYPES)
    if len(set(values)) != len(values):
        raise WideTesseraError(f"{name}: {list(values)} repeats a value")
    return values


@dataclass
class BenchmarkJob:
    """Everything the runner needs; the op class fills it in `benchmark_job`.

    model_factory(**params) -> one nn.Module (fp32, CPU; the runner moves it)
    input_factory(n, **params) -> n input tensors, one per model (fp32, CPU)
    wide_factory(modules, strategy) -> the wide nn.Module, with `pack(inputs)`
        and `unpack(output)` for its own input and output layout
    """

    op: str
    preset: str
    strategies: List[str]
    sweep: SweepParams
    model_factory: Callable[..., torch.nn.Module]
    input_factory: Callable[..., List[torch.Tensor]]
    wide_factory: Callable[[List[torch.nn.Module], str], torch.nn.Module]


def params_text(params: Dict[str, Any]) -> str:
    """'batch=8 channels=64 dtype=float32': how summaries and progress lines name a point's parameters."""
    return " ".join(f"{k}={v}" for k, v in params.items())
