"""N LoRA adapters on the segments of one batch, as Punica's and S-LoRA's segmented kernels run
them: each row of segment i gets scaling[i] * (x A_i^T) B_i^T added, in one launch.

    segmented_lora(y, x, lora_a, lora_b, scaling, group_sizes)  # y [T, O] += ..., in place

x [T, K] sorted by segment, lora_a [N, R, K] and lora_b [N, O, R] in nn.Linear's layout (PEFT's
lora_A and lora_B weights, stacked), scaling [N], group_sizes [N] counts summing to T. The
shrink (x A^T, R columns) and the expand (onto all O columns) are fused: a program keeps its
row tile's R-wide product in registers and walks the O columns with it, so the shrunk rows
never go through memory, and the base's output y is read and written once. Forward only (no
autograd): the adapters' gradients are the torch strategies'.
"""

from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

from . import INTERPRETED, dot_precision, require_triton
from .grouped_gemm import WIDEN, _tile_dot, check_group_sizes, row_tile

__all__ = ["segmented_lora", "LORA"]


def _configs() -> List[triton.Config]:
    # The interpreter runs every config it is given, in numpy: one small one.
    if INTERPRETED:
        return [triton.Config({"BM": 16, "BO": 16, "BK": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BM": bm, "BO": bo, "BK": bk}, num_warps=w, num_stages=s)
        for bm, bo, bk, w, s in [(64, 128, 64, 4, 3), (32, 128, 64, 4, 3), (64, 64, 32, 4, 4), (16, 128, 128, 4, 3)]
    ]


# Not keyed on T: the segments' token counts change with every batch.
@triton.autotune(configs=_configs(), key=["O", "K", "N", "BR"])
@triton.jit
def _lora_kernel(
    x, a, b, scaling, sizes, y, T, O, K, R, N,
    sxt, sxk, san, sar, sak, sbn, sbo, sbr, syt, syo,
    PRECISION: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    group, local, first_row, size = row_tile(pid, sizes, N, BM)
    live = group >= 0
    g = tl.maximum(group, 0)
    in_group = local * BM + tl.arange(0, BM)
    rm = first_row + in_group
    row_ok = (in_group < size) & (tl.zeros_like(in_group) + group >= 0)
    rr = tl.arange(0, BR)
    rank_ok = rr < R
    # shrink: h [BM, BR] = x[rows] A_g^T, scaled; A_g^T's [BK, BR] tiles read as W^T's are
    rk = tl.arange(0, BK)
    x_ptrs = x + rm[:, None] * sxt + rk[None, :] * sxk
    a_ptrs = a + g * san + rr[None, :] * sar + rk[:, None] * sak
    h = tl.zeros((BM, BR), dtype=tl.float32)
    h = _tile_dot(h, x_ptrs, a_ptrs, row_ok, rank_ok, K, sxk, sak, tl.where(live, K, 0), BK, PRECISION)
    h = (h * tl.load(scaling + g).to(tl.float32)).to(b.dtype.element_ty)  # rounded as torch rounds x A^T
    if WIDEN:
        h = h.to(tl.float32)
    # expand: y[rows, o0:o0+BO] += h B_g^T[:, o0:o0+BO], column tile after column tile
    for o0 in range(0, tl.where(live, O, 0), BO):
        ro = o0 + tl.arange(0, BO)
        col_ok = ro < O
        b_ptrs = b + g * sbn + ro[None, :] * sbo + rr[:, None] * sbr  # a [BR, BO] tile of B_g^T
        bt = tl.load(b_ptrs, mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        if WIDEN:
            bt = bt.to(tl.float32)
        out = y + rm[:, None] * syt + ro[None, :] * syo
        mask = row_ok[:, None] & col_ok[None, :]
        base = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (base + tl.dot(h, bt, input_precision=PRECISION)).to(y.dtype.element_ty), mask=mask)


# The autotuned kernel, for whoever wants its chosen configs (wide_tessera.kernels.facts).
LORA = _lora_kernel


def segmented_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    group_sizes: torch.Tensor,
) -> torch.Tensor:
    """y += scaling[i] * x_i lora_a[i]^T lora_b[i]^T for every segment i of x's rows, in place; returns y.

    >>> y = segmented_lora(base(x), x, wide.lora_A, wide.lora_B, wide.scaling, sizes)
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [tokens, in] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    t, k = x.shape
    if lora_a.dim() != 3 or lora_a.shape[2] != k:
        raise ValueError(f"lora_a must be [N, rank, {k}], got {tuple(lora_a.shape)}")
    n, r = lora_a.shape[:2]
    if lora_b.dim() != 3 or lora_b.shape[0] != n or lora_b.shape[2] != r:
        raise ValueError(f"lora_b must be [{n}, out, {r}], got {tuple(lora_b.shape)}")
    o = lora_b.shape[1]
    if tuple(y.shape) != (t, o):
        raise ValueError(f"y must be [{t}, {o}], got {tuple(y.shape)}")
    if len({x.dtype, lora_a.dtype, lora_b.dtype, y.dtype}) != 1:
        dtypes = ", ".join(str(t.dtype) for t in (x, lora_a, lora_b, y))
        raise ValueError(f"x, lora_a, lora_b and y must share a dtype; got {dtypes}")
    if scaling.shape != (n,):
        raise ValueError(f"scaling must hold {n} numbers, one per adapter, got {tuple(scaling.shape)}")
    check_group_sizes(group_sizes, n, x.device)
    require_triton(x.device)

    def grid(meta: dict) -> tuple:
        return (triton.cdiv(t, meta["BM"]) + n,)

    _lora_kernel[grid](
        x, lora_a, lora_b, scaling, group_sizes, y, t, o, k, r, n,
        *x.stride(), *lora_a.stride(), *lora_b.stride(), *y.stride(),
        PRECISION=dot_precision(x.dtype), BR=max(16, triton.next_power_of_2(r)),
    )  # fmt: skip
    return y
