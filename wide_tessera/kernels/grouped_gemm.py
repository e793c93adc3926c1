"""A grouped GEMM in Triton: N linear layers in one launch, over uniform or ragged groups of rows.

    y = grouped_linear(x, weight, bias)            # x [N, M, K], weight [N, O, K] -> [N, M, O]
    y = ragged_linear(tokens, weight, sizes, bias)  # tokens [T, K] sorted by group, sizes [N] -> [T, O]

Weights are in nn.Linear's layout (out x in), so a wide module's stacked weights go in as
they are. Accumulation is in float32; float32 inputs use TF32 only where the user's torch
allows it (torch.backends.cuda.matmul.allow_tf32), else full precision.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl

from . import INTERPRETED, require_triton

# See _tile_dot: the interpreter cannot multiply bfloat16.
WIDEN = tl.constexpr(INTERPRETED)

__all__ = ["grouped_linear", "ragged_linear", "GROUPED", "RAGGED"]


def _configs() -> List[triton.Config]:
    # The interpreter runs every config it is given, in numpy: one small one.
    if INTERPRETED:
        return [triton.Config({"BM": 16, "BO": 16, "BK": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BM": bm, "BO": bo, "BK": bk}, num_warps=w, num_stages=s)
        for bm, bo, bk, w, s in [
            (128, 256, 64, 8, 3),
            (128, 128, 64, 8, 4),
            (128, 128, 32, 4, 4),
            (64, 128, 64, 4, 4),
            (64, 64, 32, 4, 4),
            (32, 64, 32, 4, 3),
        ]
    ]


@triton.jit
def _tile_dot(acc, x_ptrs, w_ptrs, row_ok, col_ok, K, sxk, swk, k_end, BK: tl.constexpr, PRECISION: tl.constexpr):
    """acc += x[rows, :K] @ w[cols, :K]^T, BK columns of K at a time; out-of-range elements read as 0.

    Under the interpreter bfloat16 operands are widened first: its numpy dot reads them
    as raw 16-bit integers (triton 3.9: a bf16 16x16 product came out 1e10 off).
    """
    rk = tl.arange(0, BK)
    for k0 in range(0, k_end, BK):
        k_ok = rk + k0 < K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
        x_ptrs += BK * sxk
        w_ptrs += BK * swk
    return acc


@triton.autotune(configs=_configs(), key=["M", "O", "K"])
@triton.jit
def _grouped_kernel(
    x, w, bias, y, M, O, K,
    sxn, sxm, sxk, swn, swo, swk, sbn, syn, sym, syo,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # One program per (row tile, column tile) of one group; the group is the grid's second axis.
    pid, g = tl.program_id(0), tl.program_id(1)
    tiles_o = tl.cdiv(O, BO)
    rm = (pid // tiles_o) * BM + tl.arange(0, BM)
    ro = (pid % tiles_o) * BO + tl.arange(0, BO)
    rk = tl.arange(0, BK)
    x_ptrs = x + g * sxn + rm[:, None] * sxm + rk[None, :] * sxk
    w_ptrs = w + g * swn + ro[None, :] * swo + rk[:, None] * swk  # a [BK, BO] tile of W^T
    acc = tl.zeros((BM, BO), dtype=tl.float32)
    acc = _tile_dot(acc, x_ptrs, w_ptrs, rm < M, ro < O, K, sxk, swk, K, BK, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + g * sbn + ro, mask=ro < O, other=0.0).to(tl.float32)[None, :]
    out = y + g * syn + rm[:, None] * sym + ro[None, :] * syo
    tl.store(out, acc.to(y.dtype.element_ty), mask=(rm < M)[:, None] & (ro < O)[None, :])


# Not keyed on T: the token count changes with every routing, and tuning again for each
# would cost more than it saves (one H100 moe_experts ci sweep spent most of its 112 s so).
@triton.autotune(configs=_configs(), key=["O", "K", "N"])
@triton.jit
def _ragged_kernel(
    x, w, bias, sizes, y, T, O, K, N,
    sxt, sxk, swn, swo, swk, sbn, syt, syo,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # Row tiles are numbered group after group, each group taking cdiv(size, BM) of them; the
    # grid launches an upper bound (cdiv(T, BM) + N), so no count travels to the host. Each
    # program finds its group by walking the N sizes; programs past the last tile do nothing.
    pid, po = tl.program_id(0), tl.program_id(1)
    group, local, first_row, size = -1, 0, 0, 0
    tiles_before, rows_before = 0, 0
    for g in range(0, N):
        n_rows = tl.load(sizes + g).to(tl.int32)  # int64 sizes too; loop-carried types must not change
        n_tiles = tl.cdiv(n_rows, BM)
        mine = (pid >= tiles_before) & (pid < tiles_before + n_tiles)
        group = tl.where(mine, g, group)
        local = tl.where(mine, pid - tiles_before, local)
        first_row = tl.where(mine, rows_before, first_row)
        size = tl.where(mine, n_rows, size)
        tiles_before += n_tiles
        rows_before += n_rows
    live = group >= 0
    g = tl.maximum(group, 0)
    in_group = local * BM + tl.arange(0, BM)
    rm = first_row + in_group
    row_ok = (in_group < size) & (tl.zeros_like(in_group) + group >= 0)
    ro = po * BO + tl.arange(0, BO)
    rk = tl.arange(0, BK)
    x_ptrs = x + rm[:, None] * sxt + rk[None, :] * sxk
    w_ptrs = w + g * swn + ro[None, :] * swo + rk[:, None] * swk
    acc = tl.zeros((BM, BO), dtype=tl.float32)
    acc = _tile_dot(acc, x_ptrs, w_ptrs, row_ok, ro < O, K, sxk, swk, tl.where(live, K, 0), BK, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + g * sbn + ro, mask=(ro < O) & (tl.zeros_like(ro) + group >= 0), other=0.0).to(tl.float32)[None, :]
    out = y + rm[:, None] * syt + ro[None, :] * syo
    tl.store(out, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & (ro < O)[None, :])


# The autotuned kernels, for whoever wants their chosen configs (wide_tessera.bench.triton_analysis).
GROUPED, RAGGED = _grouped_kernel, _ragged_kernel

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _precision(dtype: torch.dtype) -> Optional[str]:
    if dtype != torch.float32:
        return None  # half types have one precision
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not INTERPRETED else "ieee"


def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], x_dims: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != x_dims:
        raise ValueError(f"x must be a {x_dims}-d tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[2] != x.shape[-1]:
        raise ValueError(f"weight must be [N, out, {x.shape[-1]}] (nn.Linear layout), got {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype of float16, bfloat16, float32; got {x.dtype}, {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    if bias is not None and (tuple(bias.shape) != tuple(weight.shape[:2]) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [N, out] = {tuple(weight.shape[:2])} in {x.dtype}, got {tuple(bias.shape)}")
    require_triton(x.device)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y[i] = x[i] @ weight[i].T + bias[i] for every group i, in one launch.

    x [N, M, K], weight [N, O, K], bias [N, O] or None -> y [N, M, O] in x's dtype.

    >>> y = grouped_linear(torch.randn(8, 128, 256, device="cuda"), wide.weight, wide.bias)
    """
    _check(x, weight, bias, 3)
    if weight.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} groups but weight {weight.shape[0]}")
    n, m, k = x.shape
    o = weight.shape[1]
    y = torch.empty(n, m, o, device=x.device, dtype=x.dtype)
    # The kernel walks a bias row with unit stride (x and weight go by their strides)
    b = bias.contiguous() if bias is not None else y  # any pointer; HAS_BIAS=False never reads it

    def grid(meta: dict) -> tuple:
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(o, meta["BO"]), n)

    _grouped_kernel[grid](
        x, weight, b, y, m, o, k,
        *x.stride(), *weight.stride(), b.stride(0), *y.stride(),
        HAS_BIAS=bias is not None, PRECISION=_precision(x.dtype),
    )  # fmt: skip
    return y


def ragged_linear(
    x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Rows of group i (they follow group i-1's) times weight[i].T plus bias[i], in one launch.

    x [T, K] sorted by group, group_sizes [N] integers summing to T (zeros allowed) on x's
    device, weight [N, O, K], bias [N, O] or None -> y [T, O]. Never waits for the device,
    so it can be captured in a CUDA graph; no group is padded to the largest.

    >>> y = ragged_linear(tokens, experts.weight, torch.tensor([300, 12, 0, 700], device="cuda"))
    """
    _check(x, weight, bias, 2)
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.shape != (weight.shape[0],):
        raise ValueError(f"group_sizes must be a tensor of {weight.shape[0]} counts, one per group")
    if group_sizes.dtype not in (torch.int32, torch.int64) or group_sizes.device != x.device:
        raise ValueError(f"group_sizes must be int32 or int64 on {x.device}, got {group_sizes.dtype} on {group_sizes.device}")
    t, k = x.shape
    n, o = weight.shape[:2]
    y = torch.empty(t, o, device=x.device, dtype=x.dtype)
    b = bias.contiguous() if bias is not None else y

    def grid(meta: dict) -> tuple:
        return (triton.cdiv(t, meta["BM"]) + n, triton.cdiv(o, meta["BO"]))

    _ragged_kernel[grid](
        x, weight, b, group_sizes, y, t, o, k, n,
        *x.stride(), *weight.stride(), b.stride(0), *y.stride(),
        HAS_BIAS=bias is not None, PRECISION=_precision(x.dtype),
    )  # fmt: skip
    return y
