"""N independent Conv1d/Conv2d/Conv3d/ConvTranspose2d layers as one grouped convolution (or a
vmap over stacked weights)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import WideTesseraError
from ..core.job import SweepParams
from ..core.layout import load_joined
from .alike import shared_config
from .base import WideChannelsOp
from .registry import register

__all__ = ["WideConv1d", "WideConv2d", "WideConv3d", "WideConvTranspose2d"]


class _WideConvNd(WideChannelsOp, nn.Module):
    """N convolutions. Wide layout: channels of the N models side by side, [B, N*C, *spatial].

    The weights are stored as one grouped-conv weight, the N models' weights concatenated on
    its first axis ([N*C_out, C_in, *k]), which every strategy can view as [N, C_out, C_in, *k]
    without a copy.
    """

    CONV: ClassVar[Callable[..., torch.Tensor]]
    FUSES: ClassVar[type]

    def __init__(
        self,
        n: int,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        bias: bool = True,
        strategy: Optional[str] = None,
    ):
        super().__init__()
        self.n, self.in_channels, self.out_channels = n, in_channels, out_channels
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.strategy = self.check_strategy(strategy)
        rows, cols = self._weight_dims()
        shape = (n * rows, cols, *self.FUSES(1, 1, kernel_size).kernel_size)
        self.weight = nn.Parameter(torch.empty(shape, memory_format=self.memory_format()))
        self.bias = nn.Parameter(torch.empty(n * out_channels)) if bias else None

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return dict(channels=module.in_channels, kernel_size=module.kernel_size[0])

    @classmethod
    def bench_model(cls, channels: int, kernel_size: int, **_: Any) -> nn.Module:
        return cls.FUSES(channels, channels, kernel_size, padding=kernel_size // 2)

    def _weight_dims(self) -> Tuple[int, int]:
        """A model's first two weight dims, its rows of the grouped weight first: torch's conv
        weight is [C_out, C_in, *k]."""
        return self.out_channels, self.in_channels

    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.strategy == "channels_last" else torch.contiguous_format

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int) -> torch.Tensor:
        return type(self).CONV(x, weight, bias, self.stride, self.padding, self.dilation, groups)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "_WideConvNd":
        config = shared_config(modules, cls.FUSES, _describe_conv)
        if config.pop("groups") != 1 or config.pop("padding_mode") != "zeros":
            raise WideTesseraError(f"{cls.__name__} fuses only groups=1, padding_mode='zeros' convolutions")
        return load_joined(cls(len(modules), strategy=strategy, **config), modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strategy == "vmap":
            return self._vmap_forward(x)
        return self._conv(x, self.weight, self.bias, self.n)

    def _vmap_forward(self, x: torch.Tensor) -> torch.Tensor:
        def one(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
            return self._conv(x, w, b, 1)

        w = self.weight.unflatten(0, (self.n, -1))
        b = None if self.bias is None else self.bias.unflatten(0, (self.n, -1))
        y = torch.func.vmap(one, in_dims=(1, 0, None if b is None else 0), out_dims=1)(
            x.unflatten(1, (self.n, self.in_channels)), w, b
        )
        return y.flatten(1, 2)


def _describe_conv(m: nn.Module) -> dict:
    transposed = dict(output_padding=m.output_padding) if m.transposed else {}
    return dict(
        **transposed,
        in_channels=m.in_channels,
        out_channels=m.out_channels,
        kernel_size=m.kernel_size,
        stride=m.stride,
        padding=m.padding,
        dilation=m.dilation,
        bias=m.bias is not None,
        groups=m.groups,
        padding_mode=m.padding_mode,
    )


@register("conv1d")
class WideConv1d(_WideConvNd):
    """N Conv1d. Strategies: 'grouped' (one conv with groups=N), 'vmap' (torch.func.vmap over the weights)."""

    CONV = F.conv1d
    FUSES = nn.Conv1d
    BENCHMARK_STRATEGIES = ("grouped", "vmap")
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], batch=[4], channels=[32], kernel_size=[3], length=[256], dtype=["float32"]),
        # N up to 16, as the other convolutions: its N=32 points took 3.4 s of the op's 11 s in the
        # quick preset of all ops (2-core CPU, 2026-11-27), far past both groups' crossovers at N=2
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16],
            batch=[8],
            channels=[32, 64],
            kernel_size=[3],
            length=[256],
            dtype=["float32", "bfloat16"],
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32, 64],
            batch=[8, 32],
            channels=[32, 64, 128],
            kernel_size=[1, 3, 7],
            length=[256, 1024],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }

    @classmethod
    def bench_inputs(cls, n: int, batch: int, channels: int, length: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, channels, length) for _ in range(n)]


@register("conv2d")
class WideConv2d(_WideConvNd):
    """N Conv2d. Strategies: 'grouped', 'channels_last' (grouped, NHWC memory layout), 'vmap'."""

    CONV = F.conv2d
    FUSES = nn.Conv2d
    BENCHMARK_STRATEGIES = ("grouped", "channels_last", "vmap")
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], batch=[2], channels=[16], kernel_size=[3], size=[16], dtype=["float32"]),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16],
            batch=[4],
            channels=[16, 32],
            kernel_size=[3],
            size=[32],
            dtype=["float32", "bfloat16"],
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32],
            batch=[8, 32],
            channels=[32, 64],
            kernel_size=[1, 3],
            size=[32, 64],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }

    @classmethod
    def bench_inputs(cls, n: int, batch: int, channels: int, size: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, channels, size, size) for _ in range(n)]


@register("conv3d")
class WideConv3d(_WideConvNd):
    """N Conv3d. Strategies: 'grouped' (one conv with groups=N), 'vmap'."""

    CONV = F.conv3d
    FUSES = nn.Conv3d
    BENCHMARK_STRATEGIES = ("grouped", "vmap")
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], batch=[1], channels=[8], kernel_size=[3], size=[8], dtype=["float32"]),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16], batch=[2], channels=[16], kernel_size=[3], size=[12], dtype=["float32", "bfloat16"]
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32],
            batch=[2, 8],
            channels=[16, 32],
            kernel_size=[1, 3],
            size=[16, 32],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }

    @classmethod
    def bench_inputs(cls, n: int, batch: int, channels: int, size: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, channels, size, size, size) for _ in range(n)]


@register("conv_transpose2d")
class WideConvTranspose2d(_WideConvNd):
    """N ConvTranspose2d (the upsampling of decoders and GANs). Strategies: 'grouped' (one
    transposed conv with groups=N), 'vmap'."""

    FUSES = nn.ConvTranspose2d
    BENCHMARK_STRATEGIES = ("grouped", "vmap")
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], batch=[2], channels=[16], kernel_size=[4], size=[8], dtype=["float32"]),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16], batch=[4], channels=[32], kernel_size=[4], size=[16], dtype=["float32", "bfloat16"]
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32],
            batch=[8, 32],
            channels=[32, 64],
            kernel_size=[2, 4],
            size=[16, 32],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }

    def __init__(self, n: int, *args: Any, output_padding: Any = 0, **kwargs: Any):
        super().__init__(n, *args, **kwargs)
        self.output_padding = output_padding

    def _weight_dims(self) -> Tuple[int, int]:
        """torch's transposed conv weight is [C_in, C_out, *k]: a model's rows are its inputs."""
        return self.in_channels, self.out_channels

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int) -> torch.Tensor:
        return F.conv_transpose2d(
            x, weight, bias, self.stride, self.padding, self.output_padding, groups, self.dilation
        )

    @classmethod
    def check_params(cls, kernel_size: int, **_: Any) -> None:
        if kernel_size < 2:  # padding (kernel_size - 2) // 2 below: torch refused the point mid-run
            raise WideTesseraError(
                f"kernel_size={kernel_size}: this op's stride-2 upsampling layer needs a kernel_size of at least 2"
            )

    @classmethod
    def bench_model(cls, channels: int, kernel_size: int, **_: Any) -> nn.Module:
        # stride 2: the upsampling layer it is in practice, output twice the input's size
        return nn.ConvTranspose2d(channels, channels, kernel_size, stride=2, padding=(kernel_size - 2) // 2)

    @classmethod
    def bench_inputs(cls, n: int, batch: int, channels: int, size: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, channels, size, size) for _ in range(n)]
