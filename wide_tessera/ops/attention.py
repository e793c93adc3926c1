"""N independent self-attention blocks, their attention done by one scaled_dot_product_attention call."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import WideTesseraError
from ..core.job import SweepParams, Work
from .alike import shared_config
from .base import TRITON, WideOp, itemsize
from .gemm import WideLinear
from .registry import register

__all__ = ["AttentionBlock", "WideAttention"]


def _check_heads(d_model: int, heads: int) -> None:
    if d_model % heads:
        raise WideTesseraError(f"d_model={d_model} is not divisible by heads={heads}; each head takes d_model/heads")


class AttentionBlock(nn.Module):
    """One self-attention block: a fused q/k/v projection, SDPA, an output projection. x: [B, L, d_model]."""

    def __init__(self, d_model: int, heads: int, causal: bool = False):
        super().__init__()
        _check_heads(d_model, heads)
        self.d_model, self.heads, self.causal = d_model, heads, causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(o.transpose(1, 2).reshape(b, length, d))


def _triton_attention_unavailable(device: torch.device, dtype: torch.dtype, params: Dict[str, Any]) -> Optional[str]:
    from ..kernels import triton_unavailable_reason

    reason = triton_unavailable_reason(device)
    if reason is not None:
        return reason
    from ..kernels.attention import HEAD_DIMS

    head_dim = params.get("d_model", 0) // max(params.get("heads", 1), 1)
    if head_dim not in HEAD_DIMS:
        return f"the Triton flash attention takes head dims {', '.join(map(str, HEAD_DIMS))}; d_model/heads={head_dim}"
    return None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, strategy: str) -> torch.Tensor:
    if strategy == "triton":
        from ..kernels import flash_attention

        return flash_attention(q, k, v, causal=causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@register("flash_attention", "attention")
class WideAttention(WideOp, nn.Module):
    """N attention blocks. Wide layout: [N, B, L, d_model]. Projections are batched matmuls (WideLinear).

    Strategies: 'batch_fold' (N folded into SDPA's batch: [N*B, H, L, hd]),
    'head_fold' (N folded into SDPA's heads: [B, N*H, L, hd]),
    'triton' (batch_fold's layout through the Triton flash attention of wide_tessera.kernels; CUDA).
    """

    BENCHMARK_STRATEGIES = ("batch_fold", "head_fold", "triton")
    STRATEGY_NEEDS = {"triton": replace(TRITON, probe=_triton_attention_unavailable)}
    FUSES = AttentionBlock
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of(
            [1, 4, 16], batch=[2], seq_len=[64], d_model=[64], heads=[4], causal=[True], dtype=["float32"]
        ),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16],
            batch=[2],
            seq_len=[128],
            d_model=[64],
            heads=[4],
            causal=[False, True],
            dtype=["float32", "bfloat16"],
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32],
            batch=[2, 8],
            seq_len=[128, 512],
            d_model=[64, 256],
            heads=[4],
            causal=[False, True],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }

    def __init__(self, n: int, d_model: int, heads: int, causal: bool = False, strategy: Optional[str] = None):
        super().__init__()
        _check_heads(d_model, heads)
        self.n, self.d_model, self.heads, self.causal = n, d_model, heads, causal
        self.strategy = self.check_strategy(strategy)
        self.qkv = WideLinear(n, d_model, 3 * d_model)
        self.out = WideLinear(n, d_model, d_model)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideAttention":
        config = shared_config(
            modules, AttentionBlock, lambda m: dict(d_model=m.d_model, heads=m.heads, causal=m.causal)
        )
        wide = cls(len(modules), strategy=strategy, **config)
        wide.qkv = WideLinear.from_modules([m.qkv for m in modules])
        wide.out = WideLinear.from_modules([m.out for m in modules])
        return wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, b, length, d = x.shape
        h, hd = self.heads, d // self.heads
        qkv = self.qkv(x).view(n, b, length, 3, h, hd)
        if self.strategy in ("batch_fold", "triton"):
            q, k, v = qkv.permute(3, 0, 1, 4, 2, 5).reshape(3, n * b, h, length, hd)
            o = _attend(q, k, v, self.causal, self.strategy)
            o = o.view(n, b, h, length, hd).permute(0, 1, 3, 2, 4)
        else:
            q, k, v = qkv.permute(3, 1, 0, 4, 2, 5).reshape(3, b, n * h, length, hd)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            o = o.view(b, n, h, length, hd).permute(1, 0, 3, 2, 4)
        return self.out(o.reshape(n, b, length, d))

    @classmethod
    def check_params(cls, d_model: int, heads: int, **_: Any) -> None:
        _check_heads(d_model, heads)

    @classmethod
    def work(cls, n: int, batch: int, seq_len: int, d_model: int, causal: bool, **params: Any) -> Work:
        # projections: 4 d x d matmuls per token; attention: QK^T and PV, half of them when causal
        tokens = n * batch * seq_len
        attention = 4.0 * n * batch * seq_len * seq_len * d_model * (0.5 if causal else 1.0)
        weights = n * (4 * d_model * d_model + 4 * d_model)
        return Work(
            8.0 * tokens * d_model * d_model + attention, float((2 * tokens * d_model + weights) * itemsize(params))
        )

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return dict(d_model=module.d_model, heads=module.heads, causal=module.causal)

    @classmethod
    def bench_model(cls, d_model: int, heads: int, causal: bool, **_: Any) -> nn.Module:
        return AttentionBlock(d_model, heads, causal)

    @classmethod
    def bench_inputs(cls, n: int, batch: int, seq_len: int, d_model: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(batch, seq_len, d_model) for _ in range(n)]
