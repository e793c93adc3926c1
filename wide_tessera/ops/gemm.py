"""N independent nn.Linear layers as one batched matrix product."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from ..core.job import SweepParams, Work
from ..core.layout import load_joined
from .alike import shared_config
from .base import TRITON, WideOp, itemsize
from .registry import register

__all__ = ["WideLinear"]


@register("gemm", "linear")
class WideLinear(WideOp, nn.Module):
    """N linear layers y_i = x_i W_i^T + b_i. Wide layout: input [N, ..., in], output [N, ..., out].

    Strategies: 'bmm' (one baddbmm over the stacked weights), 'einsum', 'triton' (the Triton
    grouped GEMM of wide_tessera.kernels: one launch, N in its grid, bias fused; CUDA).
    """

    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], batch=[16], in_features=[128], out_features=[128], dtype=["float32"]),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16, 32], batch=[16, 128], in_features=[256], out_features=[256], dtype=["float32", "bfloat16"]
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32, 64],
            batch=[16, 128, 1024],
            in_features=[256, 1024],
            out_features=[256, 1024],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }
    BENCHMARK_STRATEGIES = ("bmm", "einsum", "triton")
    STRATEGY_NEEDS = {"triton": TRITON}
    FUSES = nn.Linear

    def __init__(self, n: int, in_features: int, out_features: int, bias: bool = True, strategy: Optional[str] = None):
        super().__init__()
        self.n, self.in_features, self.out_features = n, in_features, out_features
        self.strategy = self.check_strategy(strategy)
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(n, out_features)) if bias else None

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideLinear":
        config = shared_config(
            modules,
            nn.Linear,
            lambda m: dict(in_features=m.in_features, out_features=m.out_features, bias=m.bias is not None),
        )
        return load_joined(cls(len(modules), strategy=strategy, **config), modules)

    def input_shape(self) -> Optional[List[Union[int, str]]]:
        return ["...", self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[1:-1]
        x = x.reshape(self.n, -1, self.in_features)
        if self.strategy == "bmm":
            w = self.weight.transpose(1, 2)
            y = torch.bmm(x, w) if self.bias is None else torch.baddbmm(self.bias.unsqueeze(1), x, w)
        elif self.strategy == "triton":
            from ..kernels import grouped_linear

            y = grouped_linear(x, self.weight, self.bias)
        else:
            y = torch.einsum("nbi,noi->nbo", x, self.weight)
            if self.bias is not None:
                y = y + self.bias.unsqueeze(1)
        return y.reshape(self.n, *lead, self.out_features)

    @classmethod
    def work(cls, n: int, batch: int, in_features: int, out_features: int, **params: Any) -> Work:
        # x, W, b read once, y written once
        elements = batch * in_features + out_features * in_features + out_features + batch * out_features
        return Work(2.0 * n * batch * in_features * out_features, float(n * elements * itemsize(params)))

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return dict(in_features=module.in_features, out_features=module.out_features)

    @classmethod
    def bench_model(cls, in_features: int, out_features: int, **_: Any) -> nn.Module:
        return nn.Linear(in_features, out_features)

    @classmethod
    def bench_inputs(cls, n: int, batch: int, in_features: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, in_features) for _ in range(n)]
