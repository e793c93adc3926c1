"""The Triton kernels against N separate torch calls; on a CPU under Triton's interpreter (see conftest)."""

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

import wide_tessera.kernels as kernels
from wide_tessera.kernels import (
    flash_attention,
    grouped_linear,
    ragged_linear,
    segmented_lora,
    triton_unavailable_reason,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton_unavailable_reason(DEVICE) is not None, reason=str(triton_unavailable_reason(DEVICE))
)
# Norm-wise relative error: float32 exact up to summation order; half types a few roundings.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "an element was never written or overflowed"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 37, 21, 19), (2, 16, 16, 16), (4, 5, 40, 33)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_linear_is_n_separate_linears(shape, dtype, with_bias):
    n, m, k, o = shape
    x, w = torch.randn(n, m, k, device=DEVICE), torch.randn(n, o, k, device=DEVICE)
    b = torch.randn(n, o, device=DEVICE) if with_bias else None
    ref = torch.stack([F.linear(x[i], w[i], None if b is None else b[i]) for i in range(n)])
    out = grouped_linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
    assert out.shape == (n, m, o) and out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 8, 8), (3, 37, 24, 40), (5, 20, 48, 8)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_tma_kernel_is_n_separate_linears(shape, dtype, with_bias):
    """Row, column and K tails inside every group (the copy engine's zero fill and clipping
    stand in for masks), and more tiles than programs (the persistent loop crosses groups)."""
    n, m, k, o = shape
    x, w = torch.randn(n, m, k, device=DEVICE), torch.randn(n, o, k, device=DEVICE)
    b = torch.randn(n, o, device=DEVICE) if with_bias else None
    ref = torch.stack([F.linear(x[i], w[i], None if b is None else b[i]) for i in range(n)])
    out = grouped_linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), tma=True)
    assert out.shape == (n, m, o) and out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize(
    "sizes",
    [[16, 16, 16], [40, 3, 17, 1], [0, 40, 3, 0, 17], [0, 0, 5], [23, 0], [0, 0, 0, 0], [1]],
    ids=["uniform", "skewed", "empty-inside", "empty-first", "empty-last", "all-empty", "one"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_ragged_linear_is_a_linear_per_group(sizes, dtype, with_bias):
    k, o = 21, 19
    x = torch.randn(sum(sizes), k, device=DEVICE)
    w, b = torch.randn(len(sizes), o, k, device=DEVICE), torch.randn(len(sizes), o, device=DEVICE)
    b = b if with_bias else None
    groups = torch.tensor(sizes, device=DEVICE)
    ref = torch.cat([F.linear(g, w[i], None if b is None else b[i]) for i, g in enumerate(x.split(sizes))])
    out = ragged_linear(x.to(dtype), w.to(dtype), groups, None if b is None else b.to(dtype))
    assert out.shape == (sum(sizes), o)
    if sum(sizes):
        assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length,dim", [(1, 16), (37, 16), (64, 32), (20, 64)])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_flash_attention_is_sdpa(length, dim, causal, dtype, tma):
    """With TMA, the descriptors' zero fill past L and clipped stores stand in for masks:
    lengths that no tile divides check that no head reads or writes its neighbour's rows."""
    q, k, v = (torch.randn(3, 2, length, dim, device=DEVICE) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal, tma=tma)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_flash_attention_reads_a_fused_projection_where_it_lies(tma):
    """The wide attention's q, k, v are strided views of one [Z, L, 3, H, D] projection. The
    descriptors take their strides, so TMA needs no copy: when it demanded contiguous
    tensors, the benchmark's triton strategy never reached it."""
    q, k, v = torch.randn(3, 37, 3, 2, 16, device=DEVICE).permute(2, 0, 3, 1, 4)
    assert not q.is_contiguous()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_error(flash_attention(q, k, v, causal=True, tma=tma), ref) < TOL[torch.float32]


def test_the_tma_kernel_reads_a_slice_by_its_shape_not_its_stride():
    """x's rows are 32 wide in memory but 24 in the slice: the copy engine must zero-fill past
    column 24, not read the 8 columns the slice leaves out."""
    x, w = torch.randn(3, 37, 32, device=DEVICE)[:, :, :24], torch.randn(3, 40, 24, device=DEVICE)
    ref = torch.stack([F.linear(x[i], w[i]) for i in range(3)])
    assert rel_error(grouped_linear(x, w, tma=True), ref) < TOL[torch.float32]


def lora_call(y=None, x=None, a=None, b=None, scaling=None, sizes=None):
    """segmented_lora on 2 adapters of rank 4 over 6 rows of 8 -> 5, with the one argument given changed."""
    return segmented_lora(
        torch.randn(6, 5) if y is None else y,
        torch.randn(6, 8) if x is None else x,
        torch.randn(2, 4, 8) if a is None else a,
        torch.randn(2, 5, 4) if b is None else b,
        torch.ones(2) if scaling is None else scaling,
        torch.tensor([2, 4]) if sizes is None else sizes,
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: grouped_linear(torch.randn(2, 3, 4), torch.randn(3, 5, 4)), "2 groups but weight 3"),
        (lambda: grouped_linear(torch.randn(2, 3, 4), torch.randn(2, 5, 6)), r"weight must be \[N, out, 4\]"),
        (lambda: grouped_linear(torch.randn(2, 3, 4).double(), torch.randn(2, 5, 4).double()), "share a dtype"),
        (
            lambda: grouped_linear(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(5)),
            r"bias must be \[N, out\]",
        ),
        (
            lambda: grouped_linear(torch.randn(2, 3, 4), torch.randn(2, 5, 4), tma="yes"),
            "tma must be None .*, True or False, got 'yes'",
        ),
        (
            lambda: grouped_linear(torch.randn(2, 3, 5), torch.randn(2, 8, 5), tma=True),
            r"multiple of 16 bytes .*\(2, 3, 5\) in torch.float32 has strides \(15, 5, 1\)",
        ),
        (
            lambda: grouped_linear(torch.randn(2, 8, 3).transpose(1, 2), torch.randn(2, 8, 8), tma=True),
            r"dense last dimension .*\(2, 3, 8\) has strides \(24, 1, 3\)",
        ),
        (
            lambda: grouped_linear(torch.randn(2, 0, 8), torch.randn(2, 8, 8), tma=True),
            r"TMA needs non-empty tensors; one has shape \(2, 0, 8\)",
        ),
        (lambda: ragged_linear(torch.randn(6, 4), torch.randn(2, 5, 4), torch.tensor([6])), "2 counts"),
        (lambda: ragged_linear(torch.randn(6, 4), torch.randn(2, 5, 4), torch.tensor([3.0, 3.0])), "int32 or int64"),
        (lambda: lora_call(b=torch.randn(3, 5, 4)), r"lora_b must be \[2, out, 4\], got \(3, 5, 4\)"),
        (lambda: lora_call(y=torch.randn(6, 4)), r"y must be \[6, 5\], got \(6, 4\)"),
        (lambda: lora_call(scaling=torch.ones(3)), "scaling must hold 2 numbers"),
        (lambda: lora_call(sizes=torch.tensor([6])), "2 counts"),
        (lambda: lora_call(x=torch.randn(6, 8).double()), "must share a dtype"),
        (lambda: flash_attention(*(torch.randn(1, 1, 8, 24) for _ in range(3))), "D=24 is not supported; valid: 16"),
        (
            lambda: flash_attention(torch.randn(1, 1, 8, 16), torch.randn(1, 1, 9, 16), torch.randn(1, 1, 8, 16)),
            "one shape",
        ),
        (
            lambda: flash_attention(*(torch.randn(1, 1, 16, 8).transpose(2, 3) for _ in range(3)), tma=True),
            "tma=True, but TMA needs a dense last dimension",
        ),
    ],
)
def test_bad_inputs_get_one_line_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_each_autotuned_kernel_keeps_its_own_compilations():
    """--dump-ir lists a name's compilations from the JIT function under it: when both flash
    attention names wrapped one JIT function, it wrote every specialization under both."""
    jits = [kernel.fn for kernel in kernels.autotuned_kernels().values()]
    assert len({id(jit) for jit in jits}) == len(jits)


def test_float32_uses_tf32_only_where_torch_allows_it(monkeypatch):
    # set and restored by hand: torch 2.11's cuBLAS settings object refuses monkeypatch's undo
    matmul, allowed_before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        monkeypatch.setattr(kernels, "INTERPRETED", False)
        for allowed, expected in ((True, "tf32"), (False, "ieee")):
            matmul.allow_tf32 = allowed
            assert kernels.dot_precision(torch.float32) == expected
            assert kernels.dot_precision(torch.bfloat16) is None and kernels.dot_precision(torch.float16) is None
        monkeypatch.setattr(kernels, "INTERPRETED", True)  # numpy has no TF32
        matmul.allow_tf32 = True
        assert kernels.dot_precision(torch.float32) == "ieee"
    finally:
        matmul.allow_tf32 = allowed_before


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    assert "TRITON_INTERPRET=1" in triton_unavailable_reason("cpu")
    assert triton_unavailable_reason("cuda") is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert triton_unavailable_reason("cuda") == "needs triton (pip install triton)"


@pytest.mark.parametrize(
    "call",
    [
        lambda: grouped_linear(torch.randn(2, 4, 8), torch.randn(2, 3, 8)),
        lambda: ragged_linear(torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([1, 3])),
        lambda: flash_attention(*(torch.randn(1, 1, 4, 16) for _ in range(3))),
        lora_call,
    ],
)
def test_a_kernel_that_cannot_run_here_says_why_before_launching(monkeypatch, call):
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    with pytest.raises(
        RuntimeError, match=r"^the Triton kernels cannot run on cpu: needs a CUDA device.*TRITON_INTERPRET=1"
    ):
        call()


@pytest.mark.parametrize(
    "triton_version, numpy_version, broken",
    [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.5.5", False), ("3.9.0", "2.4.6", False)],
)
def test_an_interpreter_that_fails_beside_this_numpy_is_a_reason_not_a_crash(
    monkeypatch, triton_version, numpy_version, broken
):
    import numpy
    import triton

    monkeypatch.setattr(kernels, "INTERPRETED", True)
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    reason = triton_unavailable_reason("cpu")
    assert (reason is not None) == broken
    if broken:
        assert f"Triton {triton_version}" in reason and f"numpy {numpy_version}" in reason and "triton>=3.7" in reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")
def test_kernels_at_gpu_sizes():
    x, w, b = (
        torch.randn(8, 512, 1024, device="cuda"),
        torch.randn(8, 1024, 1024, device="cuda") / 32,
        torch.randn(8, 1024, device="cuda"),
    )
    ref = torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))
    for tma in (None, False):  # None: the TMA kernel on Hopper and later
        assert rel_error(grouped_linear(x.bfloat16(), w.bfloat16(), b.bfloat16(), tma=tma), ref) < TOL[torch.bfloat16]
    sizes = [2000, 500, 0, 37, 1, 1500, 0, 9]
    flat = torch.randn(sum(sizes), 1024, device="cuda")
    ref = torch.cat([F.linear(g, w[i], b[i]) for i, g in enumerate(flat.split(sizes))])
    out = ragged_linear(flat.bfloat16(), w.bfloat16(), torch.tensor(sizes, device="cuda"), b.bfloat16())
    assert rel_error(out, ref) < TOL[torch.bfloat16]
    projection = torch.randn(4, 1024, 3, 8, 64, device="cuda")  # q, k, v as the op's fused projection lays them
    for causal, dtype, dense in itertools.product((False, True), (torch.bfloat16, torch.float32), (True, False)):
        q, k, v = (t.contiguous() if dense else t for t in projection.to(dtype).permute(2, 0, 3, 1, 4))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        for tma in (None, False):  # None: TMA on Hopper and later, by the views' strides where not dense
            out = flash_attention(q, k, v, causal=causal, tma=tma)
            assert rel_error(out, ref) < (TOL[dtype] if dtype == torch.bfloat16 else 1e-4)


def test_kernels_take_inputs_by_their_strides():
    """Views (transposed, sliced) are read where they lie: a bias slice with stride 2 once read
    its neighbours' values (relative error 0.41)."""
    x = torch.randn(3, 7, 20, device=DEVICE).transpose(1, 2)  # [3, 20, 7], not contiguous
    w = torch.randn(3, 9, 7, device=DEVICE)[:, :5]  # [3, 5, 7], a slice
    b = torch.randn(3, 10, device=DEVICE)[:, ::2]  # [3, 5], stride 2
    ref = torch.stack([F.linear(x[i], w[i], b[i]) for i in range(3)])
    assert rel_error(grouped_linear(x, w, b), ref) < TOL[torch.float32]
    tokens = torch.randn(13, 14, device=DEVICE).t()  # [14, 13], not contiguous
    sizes = [5, 0, 9]
    ref = torch.cat([F.linear(g, w[i, :, :1].expand(5, 13), b[i]) for i, g in enumerate(tokens.split(sizes))])
    out = ragged_linear(tokens, w[:, :, :1].expand(3, 5, 13), torch.tensor(sizes, device=DEVICE), b)
    assert rel_error(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("sizes", [[16, 16, 16], [40, 3, 17, 1], [0, 40, 3, 0, 17], [5]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [5, 40])
def test_segmented_lora_adds_each_adapter_on_its_segment(sizes, dtype, rank):
    """Ranks within and beyond the 16-wide rank tile; empty segments anywhere."""
    from wide_tessera.kernels import segmented_lora

    n, k, o = len(sizes), 21, 37
    x, y = torch.randn(sum(sizes), k, device=DEVICE), torch.randn(sum(sizes), o, device=DEVICE)
    a, b = torch.randn(n, rank, k, device=DEVICE), torch.randn(n, o, rank, device=DEVICE)
    scaling = torch.rand(n, device=DEVICE) + 0.5
    adapters = [F.linear(F.linear(part, a[i]), b[i]) * scaling[i] for i, part in enumerate(x.split(sizes))]
    ref = y + torch.cat(adapters)
    groups = torch.tensor(sizes, device=DEVICE)
    out = segmented_lora(y.to(dtype), x.to(dtype), a.to(dtype), b.to(dtype), scaling, groups)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype] * 2  # two products, each rounded to dtype
