"""N expert MLPs (Linear, GELU, Linear), each on its own batch of tokens: two chained wide linears."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.job import SweepParams, Work
from .alike import shared_config
from .base import TRITON, WideOp, itemsize
from .experts import Expert, expert_sizes
from .gemm import WideLinear
from .registry import register

__all__ = ["WideMLP"]


@register("mlp")
class WideMLP(WideOp, nn.Module):
    """N experts fc2(gelu(fc1(x))) with equal token counts. Wide layout: [N, tokens, d_model].

    Strategies, each the gemm op's strategy of the same name for both layers: 'bmm' (two
    baddbmm, the bias fused in), 'einsum', 'triton' (the Triton grouped GEMM, CUDA). The GELU
    runs once on the stacked hidden activations. For experts of unequal token counts (a
    router's), see moe_experts.
    """

    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], tokens=[32], d_model=[64], hidden=[128], dtype=["float32"]),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16, 32], tokens=[64], d_model=[256], hidden=[512], dtype=["float32", "bfloat16"]
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32, 64],
            tokens=[128, 1024],
            d_model=[512, 1024],
            hidden=[1024, 4096],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }
    BENCHMARK_STRATEGIES = ("bmm", "einsum", "triton")
    STRATEGY_NEEDS = {"triton": TRITON}
    FUSES = Expert

    def __init__(self, n: int, d_model: int, hidden: int, strategy: Optional[str] = None):
        super().__init__()
        self.n, self.strategy = n, self.check_strategy(strategy)
        self.fc1 = WideLinear(n, d_model, hidden, strategy=self.strategy)
        self.fc2 = WideLinear(n, hidden, d_model, strategy=self.strategy)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideMLP":
        config = shared_config(modules, Expert, lambda m: dict(d_model=m.fc1.in_features, hidden=m.fc1.out_features))
        wide = cls(len(modules), strategy=strategy, **config)
        wide.fc1 = WideLinear.from_modules([m.fc1 for m in modules], wide.strategy)
        wide.fc2 = WideLinear.from_modules([m.fc2 for m in modules], wide.strategy)
        return wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    @classmethod
    def work(cls, n: int, tokens: int, d_model: int, hidden: int, **params: Any) -> Work:
        # x, both weights and biases read once, the hidden activation written and read, y written
        elements = 2 * tokens * d_model + 2 * d_model * hidden + hidden + d_model + 2 * tokens * hidden
        return Work(4.0 * n * tokens * d_model * hidden, float(n * elements * itemsize(params)))

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return expert_sizes(module)

    @classmethod
    def bench_model(cls, d_model: int, hidden: int, **_: Any) -> nn.Module:
        return Expert(d_model, hidden)

    @classmethod
    def bench_inputs(cls, n: int, tokens: int, d_model: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(tokens, d_model) for _ in range(n)]
