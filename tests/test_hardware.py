"""Launch counts and the roofline: the numbers that say why a fused call is faster and how far from the limit."""

import json
import time

import pytest
import torch
import torch.nn.functional as F

import wide_tessera as wt
from wide_tessera.core.job import Work
from wide_tessera.kernels import grouped_linear
from wide_tessera.measurement import roofline as rl
from wide_tessera.measurement.launches import count_launches, launches_and_peak
from wide_tessera.measurement.memory import peak_memory
from wide_tessera.measurement.roofline import Peaks, roofline


def kernels_unavailable():
    from wide_tessera.kernels import triton_unavailable_reason

    return triton_unavailable_reason("cpu")


@pytest.mark.parametrize("n", [1, 3, 8])
def test_n_separate_calls_launch_n_times_what_one_fused_call_launches(n):
    xs, w, b = [torch.randn(4, 8) for _ in range(n)], torch.randn(8, 8), torch.randn(8)
    stacked, ws = torch.stack(xs), torch.stack([w] * n)
    assert count_launches(lambda: [F.linear(x, w, b) for x in xs], "cpu") == n * count_launches(
        lambda: F.linear(xs[0], w, b), "cpu"
    )
    assert count_launches(lambda: torch.bmm(stacked, ws), "cpu") == 1  # whatever N


def test_an_operator_called_inside_another_is_part_of_its_dispatch():
    x, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    assert count_launches(lambda: F.linear(x, w, b), "cpu") == 1  # aten::linear, its aten::t and aten::addmm inside
    assert count_launches(lambda: (torch.mm(x, w), torch.add(x, 1.0)), "cpu") == 2


def test_cpu_peak_memory_sees_a_temporary_freed_within_the_call():
    x = torch.randn(256, 1024)  # 1 MiB

    def call():
        temporary = x * 2  # 1 MiB, freed before the call returns
        return (temporary + 1).sum()  # another 1 MiB while both live, then a 4-byte result

    result, peak = peak_memory(call, "cpu")
    assert 2 * 2**20 <= peak < 2 * 2**20 + 1024
    assert peak_memory(lambda: None, "cpu") == (None, 0)


def test_one_profiled_call_gives_the_launches_and_the_peak_that_two_would():
    x = torch.randn(256, 1024)  # 1 MiB

    def call():
        return ((x * 2) + 1).sum()  # three operators; 2 MiB at the peak

    launches, peak = launches_and_peak(call, "cpu")
    assert (launches, peak) == (count_launches(call, "cpu"), peak_memory(call, "cpu")[1])
    assert launches == 3 and 2 * 2**20 <= peak < 2 * 2**20 + 1024


def test_every_point_records_its_launches_and_work(fast_timing):
    r = wt.benchmark(
        "gemm", preset="ci", device="cpu", verbose=False, timing=fast_timing, n_values=[1, 4], confirm="none"
    )
    one, four = r.points
    assert four.launches["baseline"] == 4 * one.launches["baseline"]
    assert four.launches["bmm"] == one.launches["bmm"]
    assert four.work.flops == 4 * one.work.flops == 4 * 2 * 16 * 128 * 128
    assert "launches/call" in r.summary()


PEAKS = Peaks("test device", "torch x", {"float32": 100.0}, copy_gbps=1000.0, measured_at="now")


def test_roofline_on_known_numbers():
    matmul = Work(flops=2 * 1024**3, min_bytes=3 * 1024**2 * 4)  # a 1024^3 float32 matmul
    r = roofline(matmul, ms=0.1, peaks=PEAKS, dtype="float32")
    assert r.tflops == pytest.approx(2 * 1024**3 / 1e-4 / 1e12)
    assert r.bound == "compute"  # intensity 171 flop/byte, above the ridge of 100
    assert r.percent_of_bound == pytest.approx(100 * (2 * 1024**3 / 100e12) / 1e-4)
    copy = Work(flops=0, min_bytes=2 * 2**30)  # a 1 GiB copy: read and written
    c = roofline(copy, ms=4.0, peaks=PEAKS, dtype="float32")
    assert c.bound == "memory" and c.gbps == pytest.approx(2 * 2**30 / 4e-3 / 1e9)
    assert c.percent_of_bound == pytest.approx(100 * (2 * 2**30 / 1e12) / 4e-3)


def test_peaks_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("WIDE_TESSERA_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(rl, "calibrate", lambda device: calls.append(device) or PEAKS)
    assert rl.load_or_calibrate("cpu") == PEAKS and rl.load_or_calibrate("cpu") == PEAKS
    assert calls == ["cpu"]
    assert rl.cache_path() == tmp_path / "peaks.json"
    rl.cache_path().write_text("{ not json")  # a damaged cache is measured again, not an error
    assert rl.load_or_calibrate("cpu") == PEAKS and calls == ["cpu", "cpu"]
    assert json.loads(rl.cache_path().read_text())


def test_a_real_calibration_gives_plausible_cpu_peaks():
    peaks = rl.calibrate("cpu")
    assert 1e-3 < peaks.tflops["float32"] < 100 and 1 < peaks.copy_gbps < 10_000


def test_roofline_run_shows_the_bound(tmp_path, monkeypatch, fast_timing):
    monkeypatch.setenv("WIDE_TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(rl, "calibrate", lambda device: PEAKS)
    r = wt.benchmark(
        "gemm",
        preset="ci",
        device="cpu",
        verbose=False,
        timing=fast_timing,
        n_values=[2],
        roofline=True,
        confirm="none",
    )
    assert r.peaks == PEAKS
    assert "roofline at the largest N" in r.summary() and "[memory-bound]" in r.summary()


class _Config:  # what triton.Config holds
    def __init__(self, num_warps, **kwargs):
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, 3


class _Compiled:  # a stand-in with the attributes triton 3.x's CompiledKernel has
    n_regs, n_spills = 168, 0

    class metadata:
        name, shared, num_warps, num_stages = "_grouped_kernel", 98304, 8, 3

    asm = {
        "ttir": "module {}",
        "ttgir": "module {} // gpu",
        "llir": "define void @k()",
        "ptx": ".version 8.7",
        "cubin": b"\x7fELF",
    }


class _Jit:
    device_caches = {0: ({"key": _Compiled()}, None, None, None)}


class _Autotuner:
    fast, slow = _Config(8, BM=128), _Config(4, BM=64)

    def __init__(self):
        self.fn = _Jit()
        self.cache = {(4096, 4096): self.fast}
        self.configs_timings = {self.fast: [1.5, 1.4, 1.6], self.slow: [2.5, 2.4, 2.6]}
        self.bench_time = 0.75


def test_triton_facts_from_triton_objects(tmp_path):
    from wide_tessera.kernels.facts import (
        autotune_facts,
        compiled_kernels,
        dump_ir,
        kernel_facts,
    )

    tuner = _Autotuner()
    ((key, compiled),) = compiled_kernels(tuner)
    assert key == "key" and kernel_facts(compiled) == kernel_facts(_Compiled())
    facts = kernel_facts(compiled)
    assert (facts.registers, facts.spills, facts.shared_bytes, facts.num_warps) == (168, 0, 98304, 8)
    (tuning,) = autotune_facts(tuner, "grouped_linear")
    assert tuning.chosen == {"BM": 128, "num_warps": 8, "num_stages": 3}
    assert [t["ms"] for t in tuning.tried] == [1.5, 2.5] and tuning.tuning_s == 0.75
    written = dump_ir({"grouped_linear": tuner}, tmp_path)
    assert sorted(p.name for p in written) == sorted(
        [f"grouped_linear.0.{s}" for s in ("ttir", "ttgir", "llir", "ptx")] + ["facts.json"]
    )
    assert (tmp_path / "grouped_linear.0.ptx").read_text() == ".version 8.7"
    assert json.loads((tmp_path / "facts.json").read_text())[0]["registers"] == 168


def test_compile_time_is_clocked_between_tritons_hooks_and_written_with_the_facts(tmp_path, monkeypatch):
    """Triton calls jit_cache_hook just before compiling and jit_post_compile_hook just after,
    with the key it caches the kernel under; here the hooks are called as triton calls them."""
    knobs = pytest.importorskip("triton").knobs
    from types import SimpleNamespace

    from wide_tessera.kernels.facts import CompileClock, dump_ir

    theirs = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **hook: theirs.append(hook["key"]))
    tuner = _Autotuner()
    hook = dict(
        key="key",
        repr="k[...]",
        fn=SimpleNamespace(jit_function=tuner.fn),
        compile={},
        is_manual_warmup=False,
        already_compiled=False,
    )
    with CompileClock() as clock:
        assert not knobs.runtime.jit_cache_hook(**hook)  # a true answer would skip the compilation
        time.sleep(0.05)
        knobs.runtime.jit_post_compile_hook(**hook)
    assert theirs == ["key"] and knobs.runtime.jit_post_compile_hook is None  # theirs still called, both restored
    assert 0.05 <= clock.of(tuner.fn, "key") < 5 and clock.of(tuner.fn, "other") is None
    dump_ir({"grouped_linear": tuner}, tmp_path, clock)
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts[0]["compile_s"] == clock.of(tuner.fn, "key") and facts[1]["autotune"]["tuning_s"] == 0.75


def test_dump_ir_under_the_interpreter_says_what_it_wrote(tmp_path):
    from click.testing import CliRunner

    from wide_tessera.cli import cli

    if kernels_unavailable():
        pytest.skip(kernels_unavailable())
    grouped_linear(torch.randn(2, 3, 16), torch.randn(2, 5, 16))
    args = ["benchmark", "gemm", "--preset", "ci", "--n-values", "1", "--device", "cpu", "--budget", "0.01"]
    r = CliRunner().invoke(cli, [*args, "--quiet", "--no-controls", "--dump-ir", str(tmp_path / "ir")])
    assert r.exit_code == 0, r.output
    readme = (tmp_path / "ir" / "README.txt").read_text()
    assert "grouped_linear" in readme and "interpreter" in readme


def test_dump_ir_into_a_file_is_refused_before_measuring(tmp_path):
    from click.testing import CliRunner

    from wide_tessera.cli import cli

    (tmp_path / "f").write_text("")
    r = CliRunner().invoke(cli, ["benchmark", "gemm", "--preset", "ci", "--dump-ir", str(tmp_path / "f")])
    assert r.exit_code == 2 and "is not a directory" in r.output
