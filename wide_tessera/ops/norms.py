"""N normalization layers: layer norms over features, and the channel norms (batch, instance
and group norms) over the channels of [B, C, ...] inputs."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

from ..core.errors import WideTesseraError
from ..core.job import SweepParams, Work
from ..core.layout import STACKED, load_joined
from .alike import shared_config
from .base import WideChannelsOp, WideOp, itemsize
from .registry import register

__all__ = [
    "WideLayerNorm",
    "WideBatchNorm1d",
    "WideBatchNorm2d",
    "WideInstanceNorm1d",
    "WideInstanceNorm2d",
    "WideGroupNorm",
]


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
            [1, 2, 4, 8, 16, 32, 64],
            batch=[64, 512, 4096],
            features=[256, 1024, 4096],
            dtype=["float32", "bfloat16", "float16"],
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
            lambda m: dict(
                shape=tuple(m.normalized_shape), eps=m.eps, affine=m.weight is not None, bias=m.bias is not None
            ),
        )
        if len(config["shape"]) != 1 or not config["affine"] or not config["bias"]:
            raise WideTesseraError("WideLayerNorm fuses LayerNorms over one axis with a weight and a bias only")
        wide = cls(len(modules), config["shape"][0], config["eps"], strategy)
        return load_joined(wide, modules)

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
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return dict(features=module.normalized_shape[-1])

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


class _WideChannelNorm(WideChannelsOp, nn.Module):
    """N norms over channels. Wide layout: the N models' channels side by side, [B, N*C, *rest].

    A channel norm computes each channel's (or group of channels') statistics on its own, so
    one call over the N*C channels is the N models' calls, and their weights, biases and
    running statistics join by concatenation. Strategies: 'stacked' (that one call) and
    'vmap' (torch.func.vmap of the one-model call over the N models' channels; it updates the
    running statistics in place, as the module does).

    A subclass sets FUSES and SPATIAL and implements `_normalize(x, n, weight, bias, mean, var)`
    for `n` models' channels side by side.
    """

    BENCHMARK_STRATEGIES = ("stacked", "vmap")
    LAYOUTS = {"num_batches_tracked": STACKED}  # one count per model; the rest joined, as the channels
    SPATIAL: ClassVar[Tuple[str, ...]]  # the sweep axes that size the input after [batch, channels]

    def __init__(
        self,
        n: int,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = False,
        strategy: Optional[str] = None,
    ):
        super().__init__()
        self.n, self.num_features, self.eps, self.momentum = n, num_features, eps, momentum
        self.in_channels = self.out_channels = num_features
        self.strategy = self.check_strategy(strategy)
        self.weight = nn.Parameter(torch.ones(n * num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(n * num_features)) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(n * num_features))
            self.register_buffer("running_var", torch.ones(n * num_features))
            # per model, as each model counts its own; all N advance together
            self.register_buffer("num_batches_tracked", torch.zeros(n, dtype=torch.long))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "_WideChannelNorm":
        config = shared_config(modules, cls.FUSES, cls._describe)
        config.pop("num_batches_tracked", None)  # checked alike, then copied with the buffers
        wide = load_joined(cls(len(modules), strategy=strategy, **config), modules)
        return wide.train(modules[0].training)  # batch statistics or running ones, as the models use

    @staticmethod
    def _describe(m: nn.Module) -> Dict[str, Any]:
        config = dict(
            num_features=m.num_features,
            eps=m.eps,
            momentum=m.momentum,
            affine=m.affine,
            track_running_stats=m.track_running_stats,
        )
        if m.momentum is None and m.track_running_stats:
            # a cumulative average weighs this batch by 1 / (batches so far): one weight for all N
            config["num_batches_tracked"] = int(m.num_batches_tracked)
        return config

    def _average_factor(self) -> float:
        """The weight of this batch in the running statistics, as torch's batch norm computes it."""
        if self.momentum is not None:
            return self.momentum
        if self.num_batches_tracked is None:
            return 0.0  # no running statistics to update
        return 1.0 / float(self.num_batches_tracked[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.n * self.num_features:
            raise WideTesseraError(
                f"{type(self).__name__}: input of shape {tuple(x.shape)}; expected [batch, "
                f"{self.n * self.num_features}, ...]"
                f" ({self.n} models of {self.num_features} channels side by side)"
            )
        if self.training and self.num_batches_tracked is not None and self._counts_batches():
            self.num_batches_tracked.add_(1)
        running = (self.running_mean, self.running_var)
        if self.strategy == "stacked":
            return self._normalize(x, self.n, self.weight, self.bias, *running)
        per_model = [None if t is None else t.unflatten(0, (self.n, -1)) for t in (self.weight, self.bias, *running)]
        in_dims = (1, *(None if t is None else 0 for t in per_model))
        one = vmap(lambda x, *t: self._normalize(x, 1, *t), in_dims=in_dims, out_dims=1)
        return one(x.unflatten(1, (self.n, -1)), *per_model).flatten(1, 2)

    def _counts_batches(self) -> bool:
        """Whether a training call counts a batch, as the module being fused does."""
        return True

    def _normalize(self, x, n, weight, bias, mean, var) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def work(cls, n: int, batch: int, channels: int, **params: Any) -> Work:
        elements = batch * channels * math.prod(params[a] for a in cls.SPATIAL)
        # about 8 flops an element (mean, variance, normalize, scale, shift); x read, y written
        return Work(8.0 * n * elements, float(n * (2 * elements + 4 * channels) * itemsize(params)))

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return dict(channels=module.num_features)

    @classmethod
    def bench_model(cls, channels: int, **_: Any) -> nn.Module:
        return _randomized(cls.FUSES(channels, affine=True, track_running_stats=True))

    @classmethod
    def bench_inputs(cls, n: int, batch: int, channels: int, **params: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, channels, *(params[a] for a in cls.SPATIAL)) for _ in range(n)]


def _randomized(norm: nn.Module) -> nn.Module:
    """Not the identity a fresh norm is, nor zero running statistics: a wrong pairing of
    channels, weights or statistics with models shows."""
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
        norm.bias.normal_()
        if getattr(norm, "running_mean", None) is not None:
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
    return norm


class _WideBatchNorm(_WideChannelNorm):
    """N BatchNorms: in training, each channel normalized over the batch (and positions), and
    each model's running statistics updated; in eval, normalized by them."""

    def _normalize(self, x, n, weight, bias, mean, var) -> torch.Tensor:
        use_batch = self.training or mean is None
        return F.batch_norm(
            x, mean, var, weight, bias, use_batch, self._average_factor() if self.training else 0.0, self.eps
        )


class _WideInstanceNorm(_WideChannelNorm):
    """N InstanceNorms: each sample's channel normalized over its positions."""

    def _counts_batches(self) -> bool:
        return False  # torch's instance norm keeps num_batches_tracked but never advances it

    def _normalize(self, x, n, weight, bias, mean, var) -> torch.Tensor:
        use_input = self.training or mean is None
        return F.instance_norm(x, mean, var, weight, bias, use_input, self.momentum, self.eps)

    @classmethod
    def bench_model(cls, channels: int, **_: Any) -> nn.Module:
        return _randomized(cls.FUSES(channels, affine=True))  # torch's default: no running statistics


def _sweeps_1d() -> Dict[str, SweepParams]:
    return {
        "ci": SweepParams.of([1, 4, 16], batch=[8], channels=[32], length=[64], dtype=["float32"]),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16, 32], batch=[16], channels=[64], length=[128], dtype=["float32", "bfloat16"]
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32, 64],
            batch=[16, 64],
            channels=[64, 256],
            length=[128, 1024],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }


def _sweeps_2d(**extra: List[Any]) -> Dict[str, SweepParams]:
    return {
        "ci": SweepParams.of([1, 4, 16], batch=[4], channels=[16], size=[16], dtype=["float32"], **extra),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16], batch=[8], channels=[32], size=[32], dtype=["float32", "bfloat16"], **extra
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32],
            batch=[8, 32],
            channels=[32, 128],
            size=[32, 64],
            dtype=["float32", "bfloat16", "float16"],
            **extra,
        ),
    }


@register("batchnorm1d")
class WideBatchNorm1d(_WideBatchNorm):
    """N nn.BatchNorm1d over [B, C, L]. Strategies: 'stacked' (one batch_norm over N*C channels), 'vmap'."""

    FUSES = nn.BatchNorm1d
    SPATIAL = ("length",)
    BENCHMARK_SWEEPS = _sweeps_1d()


@register("batchnorm2d")
class WideBatchNorm2d(_WideBatchNorm):
    """N nn.BatchNorm2d over [B, C, H, W]. Strategies: 'stacked', 'vmap'."""

    FUSES = nn.BatchNorm2d
    SPATIAL = ("size", "size")
    BENCHMARK_SWEEPS = _sweeps_2d()


@register("instancenorm1d")
class WideInstanceNorm1d(_WideInstanceNorm):
    """N nn.InstanceNorm1d over [B, C, L]. Strategies: 'stacked' (one instance_norm over N*C channels), 'vmap'."""

    FUSES = nn.InstanceNorm1d
    SPATIAL = ("length",)
    BENCHMARK_SWEEPS = _sweeps_1d()


@register("instancenorm2d")
class WideInstanceNorm2d(_WideInstanceNorm):
    """N nn.InstanceNorm2d over [B, C, H, W]. Strategies: 'stacked', 'vmap'."""

    FUSES = nn.InstanceNorm2d
    SPATIAL = ("size", "size")
    BENCHMARK_SWEEPS = _sweeps_2d()


@register("groupnorm")
class WideGroupNorm(_WideChannelNorm):
    """N nn.GroupNorm(groups, channels) over [B, C, H, W]. Strategies: 'stacked' (one group_norm
    with N*groups groups: a model's groups are consecutive channels, so they never mix models), 'vmap'."""

    FUSES = nn.GroupNorm
    SPATIAL = ("size", "size")
    BENCHMARK_SWEEPS = _sweeps_2d(groups=[4])

    def __init__(
        self,
        n: int,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        strategy: Optional[str] = None,
    ):
        super().__init__(n, num_channels, eps, None, affine, False, strategy)
        self.num_groups = num_groups

    @staticmethod
    def _describe(m: nn.Module) -> Dict[str, Any]:
        return dict(num_groups=m.num_groups, num_channels=m.num_channels, eps=m.eps, affine=m.affine)

    def _normalize(self, x, n, weight, bias, mean, var) -> torch.Tensor:
        return F.group_norm(x, n * self.num_groups, weight, bias, self.eps)

    @classmethod
    def check_params(cls, channels: int, groups: int, **_: Any) -> None:
        if channels % groups:
            raise WideTesseraError(f"groupnorm: channels={channels} must be a multiple of groups={groups}")

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return dict(channels=module.num_channels, groups=module.num_groups)

    @classmethod
    def bench_model(cls, channels: int, groups: int, **_: Any) -> nn.Module:
        return _randomized(nn.GroupNorm(groups, channels))

