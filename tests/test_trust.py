"""Verdicts that survive a busy machine and a hostile model: A/A runs, load, NaN, in-place inputs,
aliasing outputs, vmap falling back to a loop, and a confirmation pass that flips a verdict."""

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from wide_tessera import SweepParams, TimingConfig, WideOp, benchmark, benchmark_custom, register
from wide_tessera.core.correctness import check_outputs
from wide_tessera.core.stats import paired_ratio
from wide_tessera.measurement.timing import measure_paired
from wide_tessera.ops.registry import REGISTRY
from wide_tessera.results import analysis
from wide_tessera.results.decisions import compatible
from wide_tessera.sweep.runner import run

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from aa import LoopTwins  # noqa: E402  the A/A op has one home, the A/A script
from repeatability import cpu_burners  # noqa: E402  and the busy processes theirs

# Long enough samples (2 ms) for a verdict about equal costs to mean something on a CPU.
TIMING = TimingConfig(warmup_s=0.02, budget_s=0.15, min_samples=10, min_sample_s=2e-3)


@pytest.fixture
def twins():
    register("test_twins")(LoopTwins)
    yield LoopTwins
    del REGISTRY["test_twins"]


@pytest.mark.slow
def test_a_a_equal_costs_never_win_and_twins_are_always_the_same(twins):
    for seed in range(2):
        r = run(twins.benchmark_job("aa"), timing=TIMING, verbose=False, seed=seed, confirm="none")
        # a 'faster' verdict may only come from a measurement the tool itself flags as disturbed
        confident = [p for p in r.points if p.health.clean and "faster" in p.verdicts.values()]
        assert not confident, [(p.n, p.speedup_ci) for p in confident]
        assert not any(p.fused_wins for p in r.points)
        assert r.crossover_n is None and r.recommended_threshold is None and r.best_speedup is None
    torch.manual_seed(0)
    models = [nn.Linear(256, 256) for _ in range(16)]
    xs = [torch.randn(64, 256) for _ in range(16)]
    a, b = LoopTwins(models, "twin_a"), LoopTwins(models, "twin_b")
    with torch.no_grad():
        for _ in range(3):
            timed = measure_paired({"a": lambda: a(xs), "b": lambda: b(xs)}, config=TIMING)
            ci = paired_ratio(timed.stats["a"].samples_ms, timed.stats["b"].samples_ms)[1:]
            assert analysis.verdict(ci) == "same" or not timed.health.clean, (ci, timed.health)


@pytest.mark.slow
def test_a_cpu_burner_is_seen_and_never_yields_a_confident_different_verdict():
    quiet = benchmark("gemm", preset="ci", device="cpu", verbose=False, timing=TIMING, confirm="none")
    with cpu_burners(2):
        loaded = benchmark("gemm", preset="ci", device="cpu", verbose=False, timing=TIMING, confirm="none")
    assert loaded.health.max_other_load_cores > 0.5  # the burners were measured, not guessed
    seen = [line for g in loaded.groups for line in (*g.notes, *g.problems)]
    assert any("busy machine" in line or "disturbed" in line for line in seen), seen  # a note, or a reason
    # point by point: the loaded run flags a decision that could flip, or decides as the quiet run did
    (group,) = loaded.groups
    for q, p in zip(quiet.points, loaded.points):
        agree = compatible(q.decision.call, p.decision.call) and q.fused_wins == p.fused_wins
        assert group.problems or agree or "open" in (q.decision.kind, p.decision.kind), (p.n, q.winner, p.winner)


class Scale(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.w


class AdversarialScale(WideOp, nn.Module):
    """N elementwise scalings; strategies that only look right."""

    NAME = "test_adversarial"
    BENCHMARK_STRATEGIES = ("honest", "in_place", "constant")
    BENCHMARK_SWEEPS = {"test": SweepParams.of([2], d=[8])}
    nan_models = False

    def __init__(self, w: torch.Tensor, strategy=None):
        super().__init__()
        self.w, self.strategy = w, self.check_strategy(strategy)

    @classmethod
    def from_modules(cls, modules, strategy=None):
        return cls(torch.stack([m.w.detach() for m in modules]).unsqueeze(1), strategy)

    def forward(self, x):
        if self.strategy == "in_place":
            return x.mul_(self.w)  # right values, but in the caller's input tensor
        if self.strategy == "constant":
            return torch.zeros_like(x)
        return x * self.w

    @classmethod
    def bench_model(cls, d, **_):
        model = Scale(d)
        if cls.nan_models:
            model.w.data[0] = float("nan")
        return model

    @classmethod
    def bench_inputs(cls, n, d, **_):
        return [torch.randn(3, d) for _ in range(n)]


@pytest.fixture
def adversarial():
    register("test_adversarial")(AdversarialScale)
    yield AdversarialScale
    AdversarialScale.nan_models = False
    del REGISTRY["test_adversarial"]


def test_an_output_in_the_strategys_own_input_is_caught(adversarial, fast_timing):
    p = run(adversarial.benchmark_job("test"), timing=fast_timing, verbose=False).points[0]
    assert p.correct == {"honest": True, "in_place": False, "constant": False}
    assert "shares memory with the strategy's input" in p.checks["in_place"].error
    assert len(p.checks["honest"].per_model_rel_error) == 2 and p.checks["honest"].draws == 2


def test_a_nan_reference_makes_the_point_unjudgeable_never_correct(adversarial, fast_timing):
    adversarial.nan_models = True  # the separate calls give NaN; 'constant' returns zeros
    r = run(adversarial.benchmark_job("test"), timing=fast_timing, verbose=False)
    p = r.points[0]
    assert p.failures["point"].error_type == "Unjudgeable" and "NaN or Inf" in p.failures["point"].message
    assert not any(p.correct.values()) and p.best_strategy is None and r.best_speedup is None
    assert not r.all_correct


def test_an_output_that_is_the_reference_is_caught():
    ref = [torch.randn(3), torch.randn(3)]
    assert "shares memory with the reference" in check_outputs(ref, ref, 1e-4).error
    assert check_outputs([r.clone() for r in ref], ref, 1e-4).correct


class AddsToInput(nn.Module):
    """Changes its input in place: the baseline must not hand a changed input to the wide check."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(d))
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        x += self.pos
        return self.lin(x)


def test_a_model_that_changes_its_input_is_judged_on_fresh_inputs(fast_timing):
    r = benchmark_custom(AddsToInput, (4, 8), [3], device="cpu", verbose=False, timing=fast_timing)
    assert r.points[0].correct == {"vmap": True, "surgery": True}, r.points[0].checks


@pytest.mark.slow
def test_vmap_falling_back_to_a_loop_is_reported(fast_timing):
    r = benchmark_custom(
        nn.TransformerEncoderLayer,
        (3, 5, 16),
        [2],
        device="cpu",
        verbose=False,
        timing=fast_timing,
        model_kwargs=dict(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True),
    )
    check = r.points[0].checks["vmap"]
    assert check.correct and check.fallback.startswith("vmap ran a per-model loop: no batching rule for aten::")
    assert any("per-model loop" in f for f in r.points[0].flags)
    assert " loop" in r.summary() and any("per-model loop" in w for w in r.warnings)


class Flaky(WideOp, nn.Module):
    """Fast when built for a point, slow when built again for its confirmation, and fast in a third
    pass (`slow_builds` says which builds are slow): passes that contradict each other must be noticed."""

    NAME = "test_flaky"
    BENCHMARK_STRATEGIES = ("flaky",)
    BENCHMARK_SWEEPS = {"test": SweepParams.of([8], d=[64])}
    builds = 0
    slow_builds = (2,)

    def __init__(self, w: torch.Tensor, slow: bool):
        super().__init__()
        self.w, self.slow = w, slow

    @classmethod
    def from_modules(cls, modules, strategy=None):
        cls.builds += 1
        return cls(torch.stack([m.w.detach() for m in modules]).unsqueeze(1), slow=cls.builds in cls.slow_builds)

    def forward(self, x):
        if self.slow:
            for _ in range(40):
                x * self.w
        return x * self.w

    @classmethod
    def bench_model(cls, d, **_):
        return Scale(d)

    @classmethod
    def bench_inputs(cls, n, d, **_):
        # 16 rows: calls cost mostly their overhead, so the wide call is several times faster
        # than the loop and both decisions stay clear beside a busy process (256 rows left one open)
        return [torch.randn(16, d) for _ in range(n)]


def _flaky_run(slow_builds, monkeypatch):
    from wide_tessera.measurement import health

    # The passes' decisions are what is tested, so a busy machine must not make one of them
    # disturbed (a disturbed pass is outranked, not contradicted): no round counts as disturbed.
    monkeypatch.setattr(health, "MAX_LOST_FRACTION", float("inf"))
    register("test_flaky")(Flaky)
    Flaky.builds, Flaky.slow_builds = 0, slow_builds
    try:
        # a budget that settles both decisions beside a busy process too (0.15 s left one open)
        return run(Flaky.benchmark_job("test"), timing=dataclasses.replace(TIMING, budget_s=1.0), verbose=False)
    finally:
        del REGISTRY["test_flaky"]


@pytest.mark.slow
def test_a_confirmation_pass_that_flips_the_verdict_gets_a_third_pass_that_decides(monkeypatch):
    r = _flaky_run((2,), monkeypatch)
    p = r.points[0]
    assert Flaky.builds == 3 and not p.unstable and p.fused_wins and r.reliable
    assert p.verdicts["flaky"] == "faster" and p.confirmation.verdicts["flaky"] == "faster"
    assert "a third on fresh models decided fuse" in p.flags[-1]


def test_a_third_pass_that_sides_with_the_confirmation_makes_the_point_a_loop(monkeypatch):
    r = _flaky_run((2, 3), monkeypatch)  # the third pass sides with the second: a loop
    p = r.points[0]
    assert not p.unstable and not p.fused_wins and p.decision.kind == "loop"
    assert p.confirmation.decision.kind == "loop" and "a third on fresh models decided loop" in p.flags[-1]


class FakeNvml:
    """The few NVML calls the health monitor makes, with readings a test sets."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, reasons=0, clock=1980, others=0):
        self.reasons, self.clock, self.others = reasons, clock, others

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.reasons

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return self.clock if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetPowerUsage(self, handle):
        return 412_500  # milliwatts

    def nvmlDeviceGetTemperature(self, handle, kind):
        return 71

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        from types import SimpleNamespace

        return [SimpleNamespace(pid=os.getpid())] + [SimpleNamespace(pid=1) for _ in range(self.others)]


@pytest.mark.parametrize(
    "nvml,problem",
    [
        (FakeNvml(), None),
        (FakeNvml(reasons=0x40), "throttled: hw_thermal"),
        (FakeNvml(clock=900), "disturbed"),
        (FakeNvml(others=1), "busy GPU: 1 other process"),
    ],
)
def test_gpu_throttling_and_other_processes_are_seen_through_nvml(nvml, problem):
    from wide_tessera.measurement.health import HealthMonitor, Nvml

    monitor = HealthMonitor("cpu")
    monitor.gpu = Nvml(nvml, handle=None)
    disturbed = 0
    for _ in range(10):
        monitor.round_started()
        disturbed += monitor.round_disturbed()
    health = monitor.finish(10 - disturbed, disturbed)
    assert health.gpu_max_temperature_c == 71.0
    assert health.gpu_max_power_w == 412.5 and health.gpu_min_memory_clock_ratio == 1.0
    if problem is None:
        assert disturbed == 0 or not health.gpu_slowdowns
    else:
        assert any(p.startswith(problem) for p in health.problems), health.problems


def test_cli_strict_exits_3_on_an_unreliable_result_and_show_lists_every_warning(tmp_path, monkeypatch, fast_timing):
    from click.testing import CliRunner

    from wide_tessera.cli import cli
    from wide_tessera.measurement import health

    monkeypatch.setattr(health, "MAX_LOST_FRACTION", -1.0)  # every round counts as disturbed: no clean decision
    path = tmp_path / "r.json"
    # wall time: on a busy machine the run would take one thread, timed by its CPU clock, which waits do not disturb
    args = ["benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--n-values", "1,2", "--budget", "0.01"]
    result = CliRunner().invoke(cli, [*args, "--clock", "wall", "--confirm", "none", "-o", str(path), "--strict"])
    assert result.exit_code == 3, result.output
    assert "--strict: 1 unreliable result" in result.output and "UNRELIABLE" in result.output
    shown = CliRunner().invoke(cli, ["show", str(path), "--warnings"])
    assert shown.exit_code == 0 and "disturbed" in shown.output and "warning(s) of gemm" in shown.output
    assert CliRunner().invoke(cli, [*args, "--confirm", "sometimes"]).exit_code == 2
