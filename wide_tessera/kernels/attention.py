"""A flash attention forward in Triton (FlashAttention-2's online softmax), N models folded into its grid.

    o = flash_attention(q, k, v, causal=True)   # q, k, v [Z, H, L, D] -> o [Z, H, L, D]

A wide attention folds its N models into Z (Z = N * batch), so one launch covers every
model: the grid is (row blocks of L, Z * H). Softmax statistics and the output are
accumulated in float32. Semantics are scaled_dot_product_attention's: scale 1/sqrt(D) by
default, and `causal` masks keys after each query (top-left aligned, L_q == L_k).
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import INTERPRETED, dot_precision, require_triton, wants_tma

__all__ = ["flash_attention", "ATTENTION", "ATTENTION_TMA", "HEAD_DIMS"]

HEAD_DIMS = (16, 32, 64, 128)
# The interpreter cannot multiply bfloat16 (see grouped_gemm._tile_dot): widen there.
WIDEN = tl.constexpr(INTERPRETED)


def _configs(pre_hook: Optional[Callable[[dict], None]] = None) -> List[triton.Config]:
    if INTERPRETED:
        return [triton.Config({"BM": 16, "BN": 16}, num_warps=4, num_stages=1, pre_hook=pre_hook)]
    return [
        triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=s, pre_hook=pre_hook)
        for bm, bn, w, s in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4)]
    ]


def _tile_blocks(nargs: dict) -> None:
    """Give the descriptors the chosen config's tiles (the autotuner calls this before each launch)."""
    d = nargs["D"]
    nargs["q"].block_shape = nargs["o"].block_shape = [1, 1, nargs["BM"], d]
    nargs["k"].block_shape = nargs["v"].block_shape = [1, 1, nargs["BN"], d]


@triton.jit
def _attend(
    acc, total, best, q_tile, k, v, z, h, rows, cols, dims, lo, hi, L, qk_scale, skl, skd, svl, svd,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    BN: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """The online softmax over key blocks [lo, hi). Only MASKED blocks pay for a mask: those
    that reach past L or, when CAUSAL, cross the diagonal; every key of the others is seen
    by every row. Scores stay unscaled until exp2's argument, one fused multiply-add each.
    With TMA, k and v are descriptors over [Z, H, L, D], which read zeros past L; else
    pointers to this head's keys and values."""
    for start in range(lo, hi, BN):
        c = start + cols
        if TMA:
            k_tile = k.load([z, h, start, 0]).reshape(BN, D).T
            v_tile = v.load([z, h, start, 0]).reshape(BN, D)
        elif MASKED:
            k_tile = tl.load(k + c[None, :] * skl + dims[:, None] * skd, mask=c[None, :] < L, other=0.0)
            v_tile = tl.load(v + c[:, None] * svl + dims[None, :] * svd, mask=c[:, None] < L, other=0.0)
        else:
            k_tile = tl.load(k + c[None, :] * skl + dims[:, None] * skd)
            v_tile = tl.load(v + c[:, None] * svl + dims[None, :] * svd)
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


def _attention(
    q, k, v, o, H, L, scale,
    sqz, sqh, sql, sqd, skz, skh, skl, skd, svz, svh, svl, svd, soz, soh, sol, sod,
    D: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # q, k, v, o: pointers by their strides, or (TMA) descriptors over [Z, H, L, D] by theirs
    tl.static_assert(BM % BN == 0)  # a row block's diagonal is whole key blocks
    pid_m, zh = tl.program_id(0), tl.program_id(1)
    if CAUSAL:  # the longest row blocks (the last) first, so the last wave is of short ones
        pid_m = tl.num_programs(0) - 1 - pid_m
    z, h = zh // H, zh % H
    rows = pid_m * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    dims = tl.arange(0, D)
    if TMA:
        q_tile = q.load([z, h, pid_m * BM, 0]).reshape(BM, D)
        k_at, v_at = k, v
    else:
        q_tile = tl.load(
            q + z * sqz + h * sqh + rows[:, None] * sql + dims[None, :] * sqd, mask=rows[:, None] < L, other=0.0
        )
        k_at, v_at = k + z * skz + h * skh, v + z * svz + h * svh
    if WIDEN:
        q_tile = q_tile.to(tl.float32)
    best = tl.full((BM,), float("-inf"), dtype=tl.float32)  # running row maximum (log2 units)
    total = tl.zeros((BM,), dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros((BM, D), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    if CAUSAL:
        # keys before this row block are seen by all its rows; keys after its last row by none
        clear, end = pid_m * BM, tl.minimum((pid_m + 1) * BM, L)
    else:
        clear, end = (L // BN) * BN, L
    args = (k_at, v_at, z, h, rows, cols, dims)
    strides = (skl, skd, svl, svd)
    acc, total, best = _attend(
        acc, total, best, q_tile, *args, 0, clear, L, qk_scale, *strides, False, CAUSAL, PRECISION, TMA, BN, D
    )
    acc, total, best = _attend(
        acc, total, best, q_tile, *args, clear, end, L, qk_scale, *strides, True, CAUSAL, PRECISION, TMA, BN, D
    )
    acc = acc / total[:, None]
    if TMA:
        o.store([z, h, pid_m * BM, 0], acc.to(o.dtype).reshape(1, 1, BM, D))  # rows past L are clipped
    else:
        out = o + z * soz + h * soh + rows[:, None] * sol + dims[None, :] * sod
        tl.store(out, acc.to(o.dtype.element_ty), mask=rows[:, None] < L)


# One source, two JIT functions tuned apart for pointers and for descriptors: only the
# descriptors' configs carry a pre-hook, which torch.compile cannot trace (pytorch/pytorch#139059),
# and each keeps its own compiled specializations (one JIT function under both autotuners
# listed every specialization under both names, so --dump-ir wrote each twice).
_attention_kernel = triton.autotune(configs=_configs(), key=["L", "D", "CAUSAL"])(triton.jit(_attention))
_attention_tma_kernel = triton.autotune(configs=_configs(_tile_blocks), key=["L", "D", "CAUSAL"])(
    triton.jit(_attention)
)

# The autotuned kernels, for whoever wants their chosen configs (wide_tessera.kernels.facts).
ATTENTION, ATTENTION_TMA = _attention_kernel, _attention_tma_kernel


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    tma: Optional[bool] = False,
) -> torch.Tensor:
    """softmax(q k^T * scale [causal mask]) v for q, k, v [Z, H, L, D]; returns [Z, H, L, D].

    D must be one of 16, 32, 64, 128; dtypes float16, bfloat16, float32 (float32 uses TF32
    only where torch.backends.cuda.matmul.allow_tf32 allows it). `tma`: False (the default)
    loads through pointers; None moves tiles with Hopper's tensor memory accelerator where
    it can (on a GPU of capability 9.0 or later, q, k, v with a dense last dimension and
    16-byte strides, as the views of a fused q/k/v projection have), True insists. Pointer
    loads are the default because they were faster: on an H100 (torch 2.11, triton 3.6,
    bfloat16, Z=16, H=16, D=64, causal) the pointer kernel ran at 0.91x to 0.92x of SDPA and
    the TMA kernel at 0.85x to 0.87x, at L=2048 and 4096 and on projection views
    (scripts/gpu_check.py, 2026-11-26).

    >>> o = flash_attention(q, k, v, causal=True)  # q = wide q folded to [N * B, H, L, D]
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [Z, H, L, D] tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q, k, v must share a dtype of float16, bfloat16, float32; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    z, h, length, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim D={d} is not supported; valid: {', '.join(map(str, HEAD_DIMS))}")
    require_triton(q.device)
    o = torch.empty_like(q)  # q's layout where q is dense, else contiguous

    def grid(meta: dict) -> tuple:
        return (triton.cdiv(length, meta["BM"]), z * h)

    strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
    constants = dict(D=d, CAUSAL=bool(causal), PRECISION=dot_precision(q.dtype))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if wants_tma(tma, q, k, v):
        # block shapes are placeholders until _tile_blocks gives them the chosen config's tiles
        descriptors = [TensorDescriptor.from_tensor(t, [1, 1, 16, d]) for t in (q, k, v, o)]
        _attention_tma_kernel[grid](*descriptors, h, length, scale, *strides, TMA=True, **constants)
    else:
        _attention_kernel[grid](q, k, v, o, h, length, scale, *strides, TMA=False, **constants)
    return o
