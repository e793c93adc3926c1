"""Any nn.Module made wide with torch.func: stacked parameters, vmap over functional_call."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from ..bench.job import BenchmarkJob, SweepParams
from ..errors import WideTesseraError
from .base import WideOp, shared_config

__all__ = ["WideFunctional", "custom_job"]


class WideFunctional(WideOp, nn.Module):
    """N copies of one module class, run as one vmapped call. Wide layout: [N, *input_shape]."""

    NAME = "custom"
    BENCHMARK_STRATEGIES = ("vmap",)

    def __init__(self, modules: Sequence[nn.Module]):
        super().__init__()
        self.n = len(modules)
        params, buffers = stack_module_state(list(modules))
        self._param_names, self._buffer_names = list(params), list(buffers)
        self.stacked_params = nn.ParameterList([nn.Parameter(p.detach(), requires_grad=False) for p in params.values()])
        for i, b in enumerate(buffers.values()):
            self.register_buffer(f"stacked_buffer_{i}", b)
        # A structure-only copy for functional_call; kept out of the module tree so .to() and
        # state_dict see only the stacked tensors.
        self._skeleton: Tuple[nn.Module] = (copy.deepcopy(modules[0]).to("meta"),)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideFunctional":
        cls.check_strategy(strategy)
        shared_config(modules, nn.Module, lambda m: dict(cls=type(m).__name__))
        return cls(modules)

    def _state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        params = dict(zip(self._param_names, self.stacked_params))
        buffers = {name: getattr(self, f"stacked_buffer_{i}") for i, name in enumerate(self._buffer_names)}
        return params, buffers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skeleton = self._skeleton[0]

        def one(params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(skeleton, (params, buffers), (x,))

        return vmap(one)(*self._state(), x)


def custom_job(
    model_class: type,
    input_shape: Sequence[int],
    n_values: Sequence[int],
    name: str,
    dtype: str,
    model_kwargs: Dict[str, Any],
    run_check: Callable[[Callable[[], None]], None] = lambda check: check(),
) -> BenchmarkJob:
    """A job for N copies of `model_class(**model_kwargs)`, each fed an input of `input_shape`.

    The module is tried on one input first; `run_check(check)` runs that try (the API runs
    it in a worker process under `isolate`, so a module that crashes or hangs cannot take
    the caller with it).
    """
    if not (isinstance(model_class, type) and issubclass(model_class, nn.Module)):
        raise WideTesseraError(f"model_class must be an nn.Module subclass, got {model_class!r}")
    shape = tuple(input_shape) if isinstance(input_shape, (tuple, list, torch.Size)) else None
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
        raise WideTesseraError(f"input_shape must be a non-empty tuple of positive ints, got {input_shape!r}")
    sweep = SweepParams.of([1], dtype=["float32"]).with_overrides(n_values=n_values, dtype=dtype)
    run_check(partial(_check_fits, model_class, shape, model_kwargs))
    return BenchmarkJob(
        op=name,
        preset="custom",
        strategies=list(WideFunctional.BENCHMARK_STRATEGIES),
        sweep=sweep,
        # partials of module-level functions, not lambdas: an isolated run pickles the job
        model_factory=partial(_build_model, model_class, model_kwargs),
        input_factory=partial(_random_inputs, shape),
        wide_factory=WideFunctional.from_modules,
    )


def _build_model(model_class: type, model_kwargs: Dict[str, Any], **_: Any) -> nn.Module:
    return model_class(**model_kwargs)


def _random_inputs(shape: Tuple[int, ...], n: int, **_: Any) -> List[torch.Tensor]:
    return [torch.randn(shape) for _ in range(n)]


def _check_fits(model_class: type, shape: Tuple[int, ...], model_kwargs: Dict[str, Any]) -> None:
    name = model_class.__name__
    try:
        model = model_class(**model_kwargs)
    except Exception as e:
        raise WideTesseraError(f"cannot build {name}(**{model_kwargs!r}): {type(e).__name__}: {e}") from None
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros(shape))
    except Exception as e:
        raise WideTesseraError(f"input_shape {shape} does not fit {name}: {type(e).__name__}: {e}") from None
    if not isinstance(out, torch.Tensor):
        raise WideTesseraError(f"{name}.forward returns a {type(out).__name__}; benchmark_custom needs a Tensor")
