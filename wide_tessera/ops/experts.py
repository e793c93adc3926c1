"""N expert MLPs of a mixture of experts, each on the tokens routed to it: ragged groups, one wide call."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.capabilities import Needs, Probe
from ..core.errors import WideTesseraError
from ..core.job import SweepParams, Work
from .alike import shared_config
from .base import TRITON, WideOp, itemsize
from .gemm import WideLinear
from .registry import register

__all__ = ["Expert", "WideExperts", "expert_sizes", "routing_sizes", "padded_rows", "grouped_mm_probe"]


class Expert(nn.Module):
    """One expert: Linear(d_model, hidden), GELU, Linear(hidden, d_model). x: [tokens, d_model]."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, hidden), nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def expert_sizes(expert: nn.Module) -> Dict[str, Any]:
    """An Expert's d_model and hidden: the sweep axes it fixes (moe_experts', mlp's)."""
    return dict(d_model=expert.fc1.in_features, hidden=expert.fc1.out_features)


def routing_sizes(n: int, total: int, skew: float) -> List[int]:
    """Tokens per expert when `total` tokens are routed with Zipf exponent `skew`.

    Expert i gets a share proportional to (i + 1) ** -skew: 0 is uniform; at 2, half of
    64 experts get fewer than 0.1% of the tokens, and the last ones none (empty groups,
    as real routers produce). Deterministic, so every draw and pass routes alike.
    """
    weights = [(i + 1) ** -skew for i in range(n)]
    scale = total / sum(weights)
    sizes = [int(w * scale) for w in weights]
    for i in range(total - sum(sizes)):  # the remainder, one token each, to the largest shares
        sizes[i % n] += 1
    return sizes


def padded_rows(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """Where each row of groups of `sizes` rows, laid end to end, sits in the padded [groups,
    largest group] layout, so that padding and unpadding are one scatter and one gather, with no
    host synchronization."""
    largest = max(sizes)
    return torch.cat([torch.arange(s) + g * largest for g, s in enumerate(sizes)]).to(device)


def grouped_mm_probe(*axes: str) -> Probe:
    """A probe: whether torch._grouped_mm runs here on a point whose `axes` give its operands' row
    lengths. Its kernels exist for some devices and dtypes only (CUDA: compute capability 9.0 and
    bfloat16 in torch 2.11), so a tiny call asks; and its operands' rows must be multiples of 16
    bytes."""

    def probe(device: torch.device, dtype: torch.dtype, params: Dict[str, Any]) -> Optional[str]:
        if not hasattr(torch, "_grouped_mm"):
            return f"needs torch._grouped_mm, which torch {torch.__version__} lacks"
        size = torch.empty(0, dtype=dtype).element_size()
        for axis in axes:
            if params.get(axis, 0) * size % 16:
                return f"needs {axis} x {size} bytes a multiple of 16 (torch._grouped_mm); {axis}={params[axis]}"
        x, w = torch.ones(32, 16, device=device, dtype=dtype), torch.ones(2, 16, 16, device=device, dtype=dtype)
        try:
            torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
        except Exception as e:  # noqa: BLE001  whatever it raises, the kernel is missing here
            return f"torch._grouped_mm has no kernel here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        return None

    return probe


@register("moe_experts", "moe")
class WideExperts(WideOp, nn.Module):
    """N experts, expert i on the tokens routed to it. Wide layout: all tokens [T, d_model],
    sorted by expert; `pack` records how many each expert has (`sizes`).

    Strategies: 'padded' (every group padded to the largest, then batched matmuls),
    'grouped_mm' (torch._grouped_mm over the ragged groups, where this torch and device have it),
    'triton' (the Triton ragged grouped GEMM, bias fused; CUDA).
    """

    BENCHMARK_STRATEGIES = ("padded", "grouped_mm", "triton")
    STRATEGY_NEEDS = {
        # torch's meta kernel for _grouped_mm (what torch.compile traces with) takes bfloat16
        # only (torch 2.13), though the eager CPU kernel takes float32 too
        "grouped_mm": Needs(probe=grouped_mm_probe("d_model", "hidden"), compiled_dtypes=("bfloat16",)),
        "triton": TRITON,
    }
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], tokens=[32], d_model=[64], hidden=[128], skew=[0.0, 2.0], dtype=["float32"]),
        # d_model 256, hidden 512 made moe_experts a quarter of the whole quick run (54 s of 3 min
        # 42 s for 12 of 121 points): padding a skewed routing to its largest group cost the padded
        # strategy 285 ms a call at N=32, 14 times the loop, and the decision takes ten rounds of it.
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16, 32],
            tokens=[128],
            d_model=[128],
            hidden=[256],
            skew=[0.0, 1.5],
            dtype=["float32", "bfloat16"],
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32, 64],
            tokens=[128, 1024],
            d_model=[512, 1024],
            hidden=[1024, 4096],
            skew=[0.0, 1.0, 2.0],
            dtype=["float32", "bfloat16"],
        ),
    }

    def __init__(self, n: int, d_model: int, hidden: int, strategy: Optional[str] = None):
        super().__init__()
        self.n, self.d_model, self.hidden = n, d_model, hidden
        self.strategy = self.check_strategy(strategy)
        self.fc1, self.fc2 = WideLinear(n, d_model, hidden), WideLinear(n, hidden, d_model)
        self.sizes: List[int] = [0] * n
        self.register_buffer("group_sizes", torch.zeros(n, dtype=torch.int32), persistent=False)
        self.register_buffer("padded_rows", torch.zeros(0, dtype=torch.long), persistent=False)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideExperts":
        config = shared_config(
            modules, Expert, lambda m: dict(d_model=m.fc1.in_features, hidden=m.fc1.out_features)
        )
        wide = cls(len(modules), strategy=strategy, **config)
        wide.fc1 = WideLinear.from_modules([m.fc1 for m in modules])
        wide.fc2 = WideLinear.from_modules([m.fc2 for m in modules])
        return wide.to(modules[0].fc1.weight.device)

    def pack(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """All tokens, expert by expert; records each expert's count for forward and unpack.

        Routing is the caller's work (a router sorts tokens by expert once per step), so the
        counts are set here, outside what is timed, as the baseline also gets its tokens split.
        """
        if not isinstance(inputs, (list, tuple)) or len(inputs) != self.n:
            raise WideTesseraError(f"pack needs a list of {self.n} token tensors, one per expert")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.d_model:
                raise WideTesseraError(f"pack: input {i} must be a [tokens, {self.d_model}] tensor")
        self.sizes = [x.shape[0] for x in inputs]
        device = inputs[0].device
        self.group_sizes = torch.tensor(self.sizes, dtype=torch.int32, device=device)
        self.padded_rows = padded_rows(self.sizes, device)
        return torch.cat(list(inputs))

    def unpack(self, output: torch.Tensor) -> List[torch.Tensor]:
        return list(output.split(self.sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strategy == "padded":
            return self._padded(x)
        layer = self._grouped_mm if self.strategy == "grouped_mm" else self._triton
        return layer(F.gelu(layer(x, self.fc1)), self.fc2)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        largest = max(self.sizes)
        padded = x.new_zeros(self.n * largest, self.d_model).index_copy_(0, self.padded_rows, x)
        y = self.fc2(F.gelu(self.fc1(padded.view(self.n, largest, self.d_model))))
        return y.view(-1, self.d_model)[self.padded_rows]  # the rows of real tokens, in expert order

    def _grouped_mm(self, x: torch.Tensor, layer: WideLinear) -> torch.Tensor:
        offsets = self.group_sizes.cumsum(0, dtype=torch.int32)
        y = torch._grouped_mm(x, layer.weight.transpose(1, 2), offs=offsets)
        return y + layer.bias.repeat_interleave(self.group_sizes, dim=0, output_size=x.shape[0])

    def _triton(self, x: torch.Tensor, layer: WideLinear) -> torch.Tensor:
        from ..kernels import ragged_linear

        return ragged_linear(x, layer.weight, self.group_sizes, layer.bias)

    @classmethod
    def work(cls, n: int, tokens: int, d_model: int, hidden: int, **params: Any) -> Work:
        # n * tokens tokens in all (routing moves them, it does not add any); two layers
        t = n * tokens
        weights = n * (2 * d_model * hidden + hidden + d_model)
        return Work(4.0 * t * d_model * hidden, float((2 * t * d_model + weights) * itemsize(params)))

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return expert_sizes(module)

    @classmethod
    def bench_model(cls, d_model: int, hidden: int, **_: Any) -> nn.Module:
        return Expert(d_model, hidden)

    @classmethod
    def bench_inputs(cls, n: int, tokens: int, d_model: int, skew: float, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(size, d_model) for size in routing_sizes(n, tokens * n, skew)]
