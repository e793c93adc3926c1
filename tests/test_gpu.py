"""The CUDA path: device timers and every op on the GPU. Skipped where there is no CUDA device."""

import pytest
import torch

from wide_tessera import benchmark, measure

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]


def test_measure_uses_a_device_timer():
    a = torch.randn(1024, 1024, device="cuda")
    stats = measure(lambda: a @ a, device="cuda")
    assert stats.timer == "cuda_event"
    assert stats.n_samples >= 7 and 0 < stats.min_ms <= stats.median_ms


@pytest.mark.parametrize("op", ["gemm", "conv1d", "conv2d", "flash_attention"])
def test_every_op_is_correct_on_cuda_in_every_preset_dtype(op):
    r = benchmark(op, preset="quick", device="cuda", verbose=False, n_values=[1, 4])
    assert r.device == "cuda" and r.all_correct, r.failures
    assert len({p.params["dtype"] for p in r.points}) >= 2


def test_paired_cuda_timing_and_graph_mode_are_recorded():
    from wide_tessera import TimingConfig

    plain = benchmark("gemm", preset="ci", device="cuda", verbose=False)
    graphed = benchmark("gemm", preset="ci", device="cuda", verbose=False, timing=TimingConfig(cuda_graph=True))
    assert (plain.timer, graphed.timer) == ("cuda_event", "cuda_graph_event")
    assert graphed.timing.cuda_graph and plain.all_correct and graphed.all_correct


def test_energy_per_call_on_the_gpu(monkeypatch):
    """NVML's counter on a real board: every timed callable gets an energy per call and a power
    between the board's idle draw and its limit (an H100 SXM: about 70 to 700 W)."""
    from wide_tessera.measurement import energy

    why = energy.energy_unavailable("cuda")
    if why is not None:
        pytest.skip(why)
    monkeypatch.setattr(energy, "ROUNDS", 2)
    r = benchmark("gemm", preset="ci", device="cuda", verbose=False, n_values=[16], energy=True)
    p = r.points[0]
    assert set(p.energy) == set(p.timings), p.flags
    for name, e in p.energy.items():
        assert 10 < e.watts < 1500 and e.mj_per_call > 0, (name, e)
    assert "mJ/call (W)" in r.summary()


def test_compile_clock_times_a_real_compilation():
    import triton
    import triton.language as tl

    from wide_tessera.kernels.facts import CompileClock, compiled_kernels

    @triton.jit
    def add_one(x, BLOCK: tl.constexpr):  # a JIT function of its own: it compiles here, whatever ran before
        offsets = tl.arange(0, BLOCK)
        tl.store(x + offsets, tl.load(x + offsets) + 1)

    x = torch.zeros(16, device="cuda")
    with CompileClock() as clock:
        add_one[(1,)](x, BLOCK=16)
    ((key, _),) = compiled_kernels(add_one)
    assert x.sum().item() == 16 and clock.of(add_one, key) > 0


class _MakesAConstant(torch.nn.Module):
    """Runs on a GPU, under vmap too, but not in a CUDA graph: its constant is copied from the
    host's pageable memory, which capture forbids (what torch._grouped_mm in float32 does)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x) * torch.tensor([0.5], device=x.device)


def test_what_cannot_be_captured_is_skipped_with_the_reason_and_harms_nothing_after_it():
    """Under --cuda-graph, torch._grouped_mm in float32 (H100, torch 2.11) copied to the host and
    its points were reported incorrect; a function that cannot be captured is skipped instead,
    and a graphed run after it in the same process measures as before."""
    from wide_tessera import TimingConfig, benchmark_custom

    graphed = TimingConfig(cuda_graph=True)
    r = benchmark_custom(_MakesAConstant, (8, 32), [2], device="cuda", verbose=False, timing=graphed)
    skipped = [f for p in r.points for f in p.failures.values()]
    assert skipped and all(f.kind == "skipped" and "CUDA graph" in f.message for f in skipped), skipped
    assert r.all_correct and "CUDA graph" in r.summary()
    after = benchmark("gemm", preset="ci", device="cuda", verbose=False, timing=graphed)
    assert after.all_correct and not after.failures, after.failures
