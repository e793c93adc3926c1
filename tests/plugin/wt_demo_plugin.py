"""A plugin: one op of its own (demo_scale) and one strategy for the built-in gemm."""

from typing import Any, List

import torch
from torch import nn

from wide_tessera import SweepParams, WideOp, register, register_strategy


class Scale(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


@register("demo_scale")
class WideScale(WideOp, nn.Module):
    BENCHMARK_SWEEPS = {"ci": SweepParams.of([1, 2], width=[8], dtype=["float32"])}
    BENCHMARK_STRATEGIES = ("broadcast",)

    def __init__(self, modules):
        super().__init__()
        self.n = len(modules)
        self.w = nn.Parameter(torch.stack([m.w.detach() for m in modules]))

    @classmethod
    def from_modules(cls, modules, strategy=None):
        cls.check_strategy(strategy)
        return cls(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w.unsqueeze(1)

    @classmethod
    def bench_model(cls, width: int, **_: Any) -> nn.Module:
        return Scale(width)

    @classmethod
    def bench_inputs(cls, n: int, width: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(4, width) for _ in range(n)]


@register_strategy("gemm", "demo_kernel")
def demo_kernel(wide):
    def run(x):
        return torch.einsum("nbi,noi->nbo", x, wide.weight) + wide.bias.unsqueeze(1)

    return run
