"""A flash attention forward in Triton (FlashAttention-2's online softmax), N models folded into its grid.

    o = flash_attention(q, k, v, causal=True)   # q, k, v [Z, H, L, D] -> o [Z, H, L, D]

A wide attention folds its N models into Z (Z = N * batch), so one launch covers every
model: the grid is (row blocks of L, Z * H). Softmax statistics and the output are
accumulated in float32. Semantics are scaled_dot_product_attention's: scale 1/sqrt(D) by
default, and `causal` masks keys after each query (top-left aligned, L_q == L_k).
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import triton
import triton.language as tl

from . import INTERPRETED, require_triton

__all__ = ["flash_attention", "ATTENTION", "HEAD_DIMS"]

HEAD_DIMS = (16, 32, 64, 128)
# The interpreter cannot multiply bfloat16 (see grouped_gemm._tile_dot): widen there.
WIDEN = tl.constexpr(INTERPRETED)
_LOG2E = 1.4426950408889634


def _configs() -> List[triton.Config]:
    if INTERPRETED:
        return [triton.Config({"BM": 16, "BN": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4)]
    ]


@triton.jit
def _attend(
    acc, total, best, q_tile, k_base, v_base, rows, cols, dims, lo, hi, L, qk_scale, skl, skd, svl, svd,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """The online softmax over key blocks [lo, hi). Only MASKED blocks pay for a mask: those
    that reach past L or, when CAUSAL, cross the diagonal; every key of the others is seen
    by every row. Scores stay unscaled until exp2's argument, one fused multiply-add each."""
    for start in range(lo, hi, BN):
        c = start + cols
        if MASKED:
            k_tile = tl.load(k_base + c[None, :] * skl + dims[:, None] * skd, mask=c[None, :] < L, other=0.0)
            v_tile = tl.load(v_base + c[:, None] * svl + dims[None, :] * svd, mask=c[:, None] < L, other=0.0)
        else:
            k_tile = tl.load(k_base + c[None, :] * skl + dims[:, None] * skd)
            v_tile = tl.load(v_base + c[:, None] * svl + dims[None, :] * svd)
        if WIDEN:
            k_tile, v_tile = k_tile.to(tl.float32), v_tile.to(tl.float32)
        s = tl.dot(q_tile, k_tile, input_precision=PRECISION)
        if MASKED:
            keep = c[None, :] < L
            if CAUSAL:
                keep = keep & (rows[:, None] >= c[None, :])
            s = tl.where(keep, s, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, 1) * qk_scale)  # scale > 0: the max commutes with it
        p = tl.exp2(s * qk_scale - new_best[:, None])
        correction = tl.exp2(best - new_best)
        total = total * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        best = new_best
    return acc, total, best


@triton.autotune(configs=_configs(), key=["L", "D", "CAUSAL"])
@triton.jit
def _attention_kernel(
    q, k, v, o, H, L, scale,
    sqz, sqh, sql, sqd, skz, skh, skl, skd, svz, svh, svl, svd, soz, soh, sol, sod,
    D: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BM % BN == 0)  # a row block's diagonal is whole key blocks
    pid_m, zh = tl.program_id(0), tl.program_id(1)
    z, h = zh // H, zh % H
    rows = pid_m * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    dims = tl.arange(0, D)
    q_tile = tl.load(q + z * sqz + h * sqh + rows[:, None] * sql + dims[None, :] * sqd, mask=rows[:, None] < L, other=0.0)
    if WIDEN:
        q_tile = q_tile.to(tl.float32)
    k_base = k + z * skz + h * skh
    v_base = v + z * svz + h * svh
    best = tl.full((BM,), float("-inf"), dtype=tl.float32)  # running row maximum (log2 units)
    total = tl.zeros((BM,), dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros((BM, D), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    if CAUSAL:
        # keys before this row block are seen by all its rows; keys after its last row by none
        clear, end = pid_m * BM, tl.minimum((pid_m + 1) * BM, L)
    else:
        clear, end = (L // BN) * BN, L
    args = (k_base, v_base, rows, cols, dims)
    strides = (skl, skd, svl, svd)
    acc, total, best = _attend(
        acc, total, best, q_tile, *args, 0, clear, L, qk_scale, *strides, False, CAUSAL, PRECISION, BN
    )
    acc, total, best = _attend(
        acc, total, best, q_tile, *args, clear, end, L, qk_scale, *strides, True, CAUSAL, PRECISION, BN
    )
    acc = acc / total[:, None]
    out = o + z * soz + h * soh + rows[:, None] * sol + dims[None, :] * sod
    tl.store(out, acc.to(o.dtype.element_ty), mask=rows[:, None] < L)


# The autotuned kernel, for whoever wants its chosen config (wide_tessera.bench.triton_analysis).
ATTENTION = _attention_kernel


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: Optional[float] = None
) -> torch.Tensor:
    """softmax(q k^T * scale [causal mask]) v for q, k, v [Z, H, L, D]; returns [Z, H, L, D].

    D must be one of 16, 32, 64, 128; dtypes float16, bfloat16, float32 (float32 uses TF32
    only where torch.backends.cuda.matmul.allow_tf32 allows it).

    >>> o = flash_attention(q, k, v, causal=True)  # q = wide q folded to [N * B, H, L, D]
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [Z, H, L, D] tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share a dtype of float16, bfloat16, float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    z, h, length, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim D={d} is not supported; valid: {', '.join(map(str, HEAD_DIMS))}")
    require_triton(q.device)
    o = torch.empty_like(q)
    precision = None
    if q.dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 and not INTERPRETED else "ieee"

    def grid(meta: dict) -> tuple:
        return (triton.cdiv(length, meta["BM"]), z * h)

    _attention_kernel[grid](
        q, k, v, o, h, length, 1.0 / math.sqrt(d) if scale is None else scale,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        D=d, CAUSAL=bool(causal), PRECISION=precision,
    )  # fmt: skip
    return o
