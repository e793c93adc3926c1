"""N layer norms, each with its own affine weight and bias."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

from ..bench.job import SweepParams
from ..bench.registry import register
from ..bench.roofline import Work
from ..errors import WideTesseraError
from .base import WideOp, itemsize, load_joined_parameters, shared_config

__all__ = ["WideLayerNorm"]


@register("layernorm")
class WideLayerNorm(WideOp, nn.Module):
    """N nn.LayerNorm(features) with elementwise affine. Wide layout: [N, ..., features].

    Strategies: 'stacked' (one layer_norm over the stacked input, which normalizes each row on
    its own whatever model it belongs to, then each model's weight and bias broadcast over its
    rows, in place); 'vmap' (torch.func.vmap of layer_norm over the N weights and biases).
    """

    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], batch=[64], features=[256], dtype=["float32"]),
        "quick": SweepParams.of([1, 2, 4, 8, 16, 32], batch=[128], features=[512], dtype=["float32", "bfloat16"]),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32, 64], batch=[64, 512, 4096], features=[256, 1024, 4096], dtype=["float32", "bfloat16", "float16"]
        ),
    }
    BENCHMARK_STRATEGIES = ("stacked", "vmap")
    FUSES = nn.LayerNorm

    def __init__(self, n: int, features: int, eps: float = 1e-5, strategy: Optional[str] = None):
        super().__init__()
        self.n, self.features, self.eps = n, features, eps
        self.strategy = self.check_strategy(strategy)
        self.weight = nn.Parameter(torch.ones(n, features))
        self.bias = nn.Parameter(torch.zeros(n, features))

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideLayerNorm":
        config = shared_config(
            modules,
            nn.LayerNorm,
            lambda m: dict(shape=tuple(m.normalized_shape), eps=m.eps, affine=m.weight is not None, bias=m.bias is not None),
        )
        if len(config["shape"]) != 1 or not config["affine"] or not config["bias"]:
            raise WideTesseraError("WideLayerNorm fuses LayerNorms over one axis with a weight and a bias only")
        wide = cls(len(modules), config["shape"][0], config["eps"], strategy)
        return load_joined_parameters(wide, modules, torch.stack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strategy == "vmap":
            return vmap(lambda x, w, b: F.layer_norm(x, (self.features,), w, b, self.eps))(x, self.weight, self.bias)
        shape = (self.n,) + (1,) * (x.dim() - 2) + (self.features,)
        # scaled and shifted in place: a second N-times-larger temporary took it from 17.6 to 28.4 ms
        # at N=32, batch 512 on the 2-core CPU (the N separate calls: 3.1 ms), fresh pages every call
        return F.layer_norm(x, (self.features,), eps=self.eps).mul_(self.weight.view(shape)).add_(self.bias.view(shape))

    @classmethod
    def work(cls, n: int, batch: int, features: int, **params: Any) -> Work:
        # about 8 flops an element (mean, variance, normalize, scale, shift); x read, y written
        return Work(8.0 * n * batch * features, float(n * (2 * batch * features + 2 * features) * itemsize(params)))

    @classmethod
    def bench_model(cls, features: int, **_: Any) -> nn.Module:
        norm = nn.LayerNorm(features)
        with torch.no_grad():  # not the identity a fresh LayerNorm is: a wrong pairing of weights shows
            norm.weight.normal_(1.0, 0.5)
            norm.bias.normal_()
        return norm

    @classmethod
    def bench_inputs(cls, n: int, batch: int, features: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, features) for _ in range(n)]
