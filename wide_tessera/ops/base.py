"""The contract every op class fulfils, so the generic runner can benchmark it."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..bench.job import BenchmarkJob, SweepParams
from ..errors import WideTesseraError, unknown

__all__ = ["WideOp", "shared_config", "load_joined_parameters"]


class WideOp:
    """Mixin for a wide nn.Module: N copies of one op fused into one module.

    A subclass sets BENCHMARK_SWEEPS (preset -> SweepParams) and
    BENCHMARK_STRATEGIES (its wide strategies; the first is the default, and the
    runner adds 'baseline', N separate calls), and implements:

    bench_model(**params) -> one nn.Module of the kind being fused
    bench_inputs(n, **params) -> n inputs, one per model
    from_modules(modules, strategy) -> the wide module
    pack(inputs) -> the wide input; unpack(output) -> n outputs (default: stacked on axis 0)
    """

    NAME: ClassVar[str]
    BENCHMARK_SWEEPS: ClassVar[Dict[str, SweepParams]]
    BENCHMARK_STRATEGIES: ClassVar[Tuple[str, ...]]

    @classmethod
    def benchmark_job(cls, preset: str = "full", **overrides: Any) -> BenchmarkJob:
        if preset not in cls.BENCHMARK_SWEEPS:
            raise unknown(f"preset for {cls.NAME}", preset, cls.BENCHMARK_SWEEPS)
        return BenchmarkJob(
            op=cls.NAME,
            preset=preset,
            strategies=list(cls.BENCHMARK_STRATEGIES),
            sweep=cls.BENCHMARK_SWEEPS[preset].with_overrides(**overrides),
            model_factory=cls.bench_model,
            input_factory=cls.bench_inputs,
            wide_factory=cls.from_modules,
        )

    @classmethod
    def check_strategy(cls, strategy: Optional[str]) -> str:
        """The strategy to use: the default for None, else a known name."""
        if strategy is None:
            return cls.BENCHMARK_STRATEGIES[0]
        if strategy not in cls.BENCHMARK_STRATEGIES:
            raise unknown(f"strategy for {cls.NAME}", strategy, cls.BENCHMARK_STRATEGIES)
        return strategy

    @classmethod
    def bench_model(cls, **params: Any) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def bench_inputs(cls, n: int, **params: Any) -> List[torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> nn.Module:
        raise NotImplementedError

    def pack(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The default wide layout: the N inputs stacked on a new leading axis."""
        return torch.stack(list(inputs))

    def unpack(self, output: torch.Tensor) -> List[torch.Tensor]:
        return list(output.unbind(0))


def shared_config(
    modules: Sequence[nn.Module], kind: type, describe: Callable[[nn.Module], Dict[str, Any]]
) -> Dict[str, Any]:
    """The configuration `describe` finds in all `modules`; a clear error if they are not alike."""
    if len(modules) == 0:
        raise WideTesseraError("from_modules needs at least one module, got none")
    for i, m in enumerate(modules):
        if not isinstance(m, kind):
            raise WideTesseraError(f"module {i} is a {type(m).__name__}; expected {kind.__name__}")
    config = describe(modules[0])
    for i, m in enumerate(modules[1:], start=1):
        for key, value in describe(m).items():
            if value != config[key]:
                raise WideTesseraError(
                    f"module {i} has {key}={value!r} but module 0 has {config[key]!r}; all modules must match"
                )
    return config


def load_joined_parameters(
    wide: nn.Module, modules: Sequence[nn.Module], join: Callable[[List[torch.Tensor]], torch.Tensor]
) -> nn.Module:
    """Move `wide` to the modules' device and dtype; fill its weight and bias by joining theirs."""
    ref = modules[0].weight
    wide.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        wide.weight.copy_(join([m.weight for m in modules]))
        if wide.bias is not None:
            wide.bias.copy_(join([m.bias for m in modules]))
    return wide
