"""Timers: what measure() returns on a CPU, and how it drives triton's do_bench on a GPU."""

import sys
import time
import types

import torch

import wide_tessera
from wide_tessera import TimingConfig, measure


def test_measure_keeps_samples_and_statistics():
    stats = measure(lambda: torch.ones(64).sum(), device="cpu")
    assert stats.timer == "cpu_perf_counter"
    assert stats.n_samples == len(stats.samples_ms) >= 7
    assert stats.calls_per_sample > 1  # a microsecond call is looped so timer overhead is negligible
    assert stats.min_ms <= stats.median_ms <= stats.max_ms and stats.iqr_ms >= 0 and stats.std_ms >= 0


def test_measure_is_not_fooled_about_a_known_duration():
    stats = measure(lambda: time.sleep(0.002), device="cpu")
    assert 2.0 <= stats.median_ms < 20.0


def test_timing_stats_from_known_samples():
    stats = wide_tessera.TimingStats.from_samples([1.0, 2.0, 3.0, 4.0, 100.0], "t")
    assert (stats.median_ms, stats.min_ms, stats.max_ms, stats.mean_ms) == (3.0, 1.0, 100.0, 22.0)
    assert stats.iqr_ms == 2.0  # 4 - 2 with linear interpolation


def test_gpu_path_asks_do_bench_for_every_sample_in_ms(monkeypatch):
    """No GPU is needed to check our side of do_bench's contract: ms budgets in, all samples out."""
    calls = []

    def fake_do_bench(fn, warmup, rep, return_mode):
        calls.append((warmup, rep, return_mode))
        fn()
        return [0.5, 0.25, 1.0]

    triton = types.ModuleType("triton")
    triton.testing = types.SimpleNamespace(do_bench=fake_do_bench)
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.testing", triton.testing)
    ran = []
    stats = measure(lambda: ran.append(1), device="cuda", config=TimingConfig(warmup_s=0.02, budget_s=0.1))
    assert calls == [(20.0, 100.0, "all")] and ran == [1]
    assert (stats.timer, stats.samples_ms, stats.median_ms) == ("triton_do_bench", [0.5, 0.25, 1.0], 0.5)
