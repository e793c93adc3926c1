"""A grouped GEMM in Triton: N linear layers in one launch, over uniform or ragged groups of rows.

    y = grouped_linear(x, weight, bias)            # x [N, M, K], weight [N, O, K] -> [N, M, O]
    y = ragged_linear(tokens, weight, sizes, bias)  # tokens [T, K] sorted by group, sizes [N] -> [T, O]

Weights are in nn.Linear's layout (out x in), so a wide module's stacked weights go in as
they are. Accumulation is in float32; float32 inputs use TF32 only where the user's torch
allows it (torch.backends.cuda.matmul.allow_tf32), else full precision.

On Hopper and later, grouped_linear moves its tiles with the tensor memory accelerator (TMA)
in a persistent kernel where the tensors' layout allows it (`tma=None`); elsewhere, and
with `tma=False`, it loads through pointers. On an H100 (N=8, 4096 tokens, 4096x4096,
bfloat16; scripts/gpu_check.py, 2026-11-26) the TMA kernel ran at 0.98x of bmm [0.97, 0.98],
the pointer kernel at 0.81x (docs/validating.md, "Measured on a GPU").
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import INTERPRETED, dot_precision, require_triton, wants_tma

# See _tile_dot: the interpreter cannot multiply bfloat16.
WIDEN = tl.constexpr(INTERPRETED)

__all__ = ["grouped_linear", "ragged_linear", "row_tile", "check_group_sizes", "GROUPED", "GROUPED_TMA", "RAGGED"]


def _configs(pre_hook: Optional[Callable[[dict], None]] = None) -> List[triton.Config]:
    # The interpreter runs every config it is given, in numpy: one small one.
    if INTERPRETED:
        return [triton.Config({"BM": 16, "BO": 16, "BK": 16}, num_warps=4, num_stages=1, pre_hook=pre_hook)]
    return [
        triton.Config({"BM": bm, "BO": bo, "BK": bk}, num_warps=w, num_stages=s, pre_hook=pre_hook)
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


def _tile_blocks(nargs: dict) -> None:
    """Give the descriptors the chosen config's tile (the autotuner calls this before each launch)."""
    bm, bo, bk = nargs["BM"], nargs["BO"], nargs["BK"]
    nargs["x"].block_shape, nargs["w"].block_shape, nargs["y"].block_shape = [1, bm, bk], [1, bo, bk], [1, bm, bo]


@triton.jit
def _tile_origin(tile, per_group, tiles_o, BM: tl.constexpr, BO: tl.constexpr):
    """Tile number -> (group, first row, first column); tiles go group after group."""
    local = tile % per_group
    return tile // per_group, (local // tiles_o) * BM, (local % tiles_o) * BO


@triton.autotune(configs=_configs(_tile_blocks), key=["M", "O", "K", "N"])
@triton.jit
def _grouped_tma_kernel(
    x, w, bias, y, M, O, K, N, sbn,
    PROGRAMS: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # x, w, y are TMA descriptors over [N, M, K], [N, O, K], [N, M, O]: the copy engine zero-fills
    # reads past each group's edges and clips writes to them, so no tile needs a mask. PROGRAMS
    # programs (one per SM) walk all groups' tiles, so one tile's loads overlap the last one's
    # store; the store's tile is counted apart (out), as Triton's persistent matmul tutorial
    # does, since the pipeliner cannot carry one value from the loads to the epilogue.
    tiles_o = tl.cdiv(O, BO)
    per_group = tl.cdiv(M, BM) * tiles_o
    out = tl.program_id(0) - PROGRAMS
    for tile in tl.range(tl.program_id(0), per_group * N, PROGRAMS, flatten=True):
        g, m0, o0 = _tile_origin(tile, per_group, tiles_o, BM, BO)
        acc = tl.zeros((BM, BO), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = x.load([g, m0, k0]).reshape(BM, BK)
            b = w.load([g, o0, k0]).reshape(BO, BK)
            if WIDEN:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        out += PROGRAMS
        g, m0, o0 = _tile_origin(out, per_group, tiles_o, BM, BO)
        if HAS_BIAS:
            ro = o0 + tl.arange(0, BO)
            acc += tl.load(bias + g * sbn + ro, mask=ro < O, other=0.0).to(tl.float32)[None, :]
        y.store([g, m0, o0], acc.to(y.dtype).reshape(1, BM, BO))


@triton.jit
def row_tile(pid, sizes, N, BM: tl.constexpr):
    """Row tile `pid` of groups of `sizes` rows laid end to end -> (its group, or -1 past the last
    tile; its tile number in the group; the group's first row; the group's size). Tiles are
    numbered group after group, each group taking cdiv(size, BM); each program walks the N sizes,
    so no count travels to the host."""
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
    return group, local, first_row, size


# Not keyed on T: the token count changes with every routing, and tuning again for each
# would cost more than it saves (one H100 moe_experts ci sweep spent most of its 112 s so).
@triton.autotune(configs=_configs(), key=["O", "K", "N"])
@triton.jit
def _ragged_kernel(
    x, w, bias, sizes, y, T, O, K, N,
    sxt, sxk, swn, swo, swk, sbn, syt, syo,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # The grid launches an upper bound of row tiles (cdiv(T, BM) + N); each program finds its
    # group (row_tile); programs past the last tile do nothing.
    pid, po = tl.program_id(0), tl.program_id(1)
    group, local, first_row, size = row_tile(pid, sizes, N, BM)
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
        acc += tl.load(bias + g * sbn + ro, mask=(ro < O) & (tl.zeros_like(ro) + group >= 0), other=0.0).to(tl.float32)[
            None, :
        ]
    out = y + rm[:, None] * syt + ro[None, :] * syo
    tl.store(out, acc.to(y.dtype.element_ty), mask=row_ok[:, None] & (ro < O)[None, :])


# The autotuned kernels, for whoever wants their chosen configs (wide_tessera.kernels.facts).
GROUPED, GROUPED_TMA, RAGGED = _grouped_kernel, _grouped_tma_kernel, _ragged_kernel

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], x_dims: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != x_dims:
        raise ValueError(f"x must be a {x_dims}-d tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[2] != x.shape[-1]:
        raise ValueError(f"weight must be [N, out, {x.shape[-1]}] (nn.Linear layout), got {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x and weight must share a dtype of float16, bfloat16, float32; got {x.dtype}, {weight.dtype}"
        )
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    if bias is not None and (tuple(bias.shape) != tuple(weight.shape[:2]) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [N, out] = {tuple(weight.shape[:2])} in {x.dtype}, got {tuple(bias.shape)}")
    require_triton(x.device)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, tma: Optional[bool] = None
) -> torch.Tensor:
    """y[i] = x[i] @ weight[i].T + bias[i] for every group i, in one launch.

    x [N, M, K], weight [N, O, K], bias [N, O] or None -> y [N, M, O] in x's dtype. `tma`:
    None uses the TMA kernel where it can run (see the module's docstring), True insists on
    it, False never uses it.

    >>> y = grouped_linear(torch.randn(8, 128, 256, device="cuda"), wide.weight, wide.bias)
    """
    _check(x, weight, bias, 3)
    if weight.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} groups but weight {weight.shape[0]}")
    y = torch.empty(*x.shape[:2], weight.shape[1], device=x.device, dtype=x.dtype)
    # The kernels walk a bias row with unit stride (x and weight go by their strides)
    b = bias.contiguous() if bias is not None else y  # any pointer; HAS_BIAS=False never reads it
    launch = _launch_tma if wants_tma(tma, x, weight, y) else _launch_pointers
    launch(x, weight, b, y, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype))
    return y


def _launch_pointers(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor, **constants) -> None:
    n, m, k = x.shape
    o = w.shape[1]

    def grid(meta: dict) -> tuple:
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(o, meta["BO"]), n)

    _grouped_kernel[grid](x, w, b, y, m, o, k, *x.stride(), *w.stride(), b.stride(0), *y.stride(), **constants)


def _launch_tma(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor, **constants) -> None:
    n, m, k = x.shape
    o = w.shape[1]
    # One program per SM; under the interpreter two, fewer than the tiles, so tests walk the loop.
    programs = 2 if INTERPRETED else torch.cuda.get_device_properties(x.device).multi_processor_count

    def grid(meta: dict) -> tuple:
        return (min(programs, n * triton.cdiv(m, meta["BM"]) * triton.cdiv(o, meta["BO"])),)

    # block shapes are placeholders until _tile_blocks gives them the chosen config's tile
    x_d, w_d, y_d = (TensorDescriptor.from_tensor(t, [1, 16, 16]) for t in (x, w, y))
    _grouped_tma_kernel[grid](x_d, w_d, b, y_d, m, o, k, n, b.stride(0), PROGRAMS=programs, **constants)


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
    check_group_sizes(group_sizes, weight.shape[0], x.device)
    t, k = x.shape
    n, o = weight.shape[:2]
    y = torch.empty(t, o, device=x.device, dtype=x.dtype)
    b = bias.contiguous() if bias is not None else y

    def grid(meta: dict) -> tuple:
        return (triton.cdiv(t, meta["BM"]) + n, triton.cdiv(o, meta["BO"]))

    _ragged_kernel[grid](
        x, weight, b, group_sizes, y, t, o, k, n,
        *x.stride(), *weight.stride(), b.stride(0), *y.stride(),
        HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype),
    )  # fmt: skip
    return y


def check_group_sizes(group_sizes: torch.Tensor, n: int, device: torch.device) -> None:
    """One ValueError unless `group_sizes` is n int32 or int64 counts on `device`."""
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.shape != (n,):
        raise ValueError(f"group_sizes must be a tensor of {n} counts, one per group")
    if group_sizes.dtype not in (torch.int32, torch.int64) or group_sizes.device != device:
        raise ValueError(
            f"group_sizes must be int32 or int64 on {device}, got {group_sizes.dtype} on {group_sizes.device}"
        )
