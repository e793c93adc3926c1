"""Launch counts and the roofline: the numbers that say why a fused call is faster and how far from the limit."""

import json

import pytest
import torch
import torch.nn.functional as F

import wide_tessera as wt
from wide_tessera.bench import roofline as rl
from wide_tessera.bench.launches import count_launches
from wide_tessera.bench.roofline import Peaks, Work, roofline


@pytest.mark.parametrize("n", [1, 3, 8])
def test_n_separate_calls_launch_n_times_what_one_fused_call_launches(n):
    xs, w, b = [torch.randn(4, 8) for _ in range(n)], torch.randn(8, 8), torch.randn(8)
    stacked, ws = torch.stack(xs), torch.stack([w] * n)
    assert count_launches(lambda: [F.linear(x, w, b) for x in xs], "cpu") == n * count_launches(lambda: F.linear(xs[0], w, b), "cpu")
    assert count_launches(lambda: torch.bmm(stacked, ws), "cpu") == 1  # whatever N


def test_every_point_records_its_launches_and_work(fast_timing):
    r = wt.benchmark("gemm", preset="ci", device="cpu", verbose=False, timing=fast_timing, n_values=[1, 4], confirm="none")
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
    r = wt.benchmark("gemm", preset="ci", device="cpu", verbose=False, timing=fast_timing, n_values=[2], roofline=True, confirm="none")
    assert r.peaks == PEAKS
    assert "roofline at the largest N" in r.summary() and "[memory-bound]" in r.summary()
