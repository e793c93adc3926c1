"""Compiled runs, the controls (the loop graphed or compiled, which fuse nothing) and capability gating."""

import json

import pytest
import torch
from click.testing import CliRunner

from wide_tessera.cli import cli
from wide_tessera.core.capabilities import Needs, unmet_need
from wide_tessera.core.job import SweepParams
from wide_tessera.measurement import modes
from wide_tessera.ops import WideLinear
from wide_tessera.results import analysis
from wide_tessera.sweep.runner import run


class CompiledWrongLinear(WideLinear):
    """'bmm' is right; 'compiled_wrong' is right in eager mode and wrong once torch.compile traces it."""

    BENCHMARK_STRATEGIES = ("bmm", "compiled_wrong")
    BENCHMARK_SWEEPS = {"test": SweepParams.of([1, 4], batch=[4], in_features=[8], out_features=[8])}

    def forward(self, x):
        y = super().forward(x)
        if self.strategy == "compiled_wrong" and torch.compiler.is_compiling():
            return y * 1.5
        return y


class GatedLinear(WideLinear):
    """Strategies that need what a CPU run cannot give, or a dtype, or what a probe says."""

    BENCHMARK_STRATEGIES = ("bmm", "on_cuda", "bf16_only", "probed")
    BENCHMARK_SWEEPS = {"test": SweepParams.of([1, 2], batch=[4], in_features=[8], out_features=[8])}
    STRATEGY_NEEDS = {
        "on_cuda": Needs(cuda=True),
        "bf16_only": Needs(dtypes=("bfloat16",)),
        "probed": Needs(probe=lambda device, dtype, params: f"no kernel for {dtype} on {device.type}"),
    }

    def forward(self, x):
        if self.strategy in ("on_cuda", "bf16_only", "probed"):
            raise AssertionError("a gated strategy must never run")
        return super().forward(x)


@pytest.mark.slow
def test_compiled_strategy_is_what_is_checked(fast_timing):
    r = run(CompiledWrongLinear.benchmark_job("test"), timing=fast_timing, verbose=False, compile="default")
    assert r.compile == "default"
    for p in r.points:
        assert p.correct == {"bmm": True, "compiled_wrong": False}
        assert "exceeds tolerance" in p.checks["compiled_wrong"].error
        # each compiled callable's first call compiled it, and was timed as such
        assert set(p.first_call_s) == {"baseline", "bmm", "compiled_wrong"} and min(p.first_call_s.values()) > 0
    assert "torch.compile mode default on every side" in r.summary()


def test_eager_run_of_the_same_op_passes(fast_timing):
    r = run(CompiledWrongLinear.benchmark_job("test"), timing=fast_timing, verbose=False)
    assert r.all_correct and all(set(p.first_call_s) == {"baseline", "bmm", "compiled_wrong"} for p in r.points)


def test_a_baseline_that_compiles_wrong_fails_the_point(fast_timing):
    class Model(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + (1.0 if torch.compiler.is_compiling() else 0.0)

    job = WideLinear.benchmark_job("ci", n_values=[2])
    job.model_factory = lambda in_features, out_features, **_: Model(in_features, out_features)
    job.wide_factory = lambda modules, strategy: WideLinear.from_modules(
        [torch.nn.Linear(m.in_features, m.out_features) for m in modules], strategy
    )
    r = run(job, timing=fast_timing, verbose=False, compile="default", confirm="none")
    failure = r.points[0].failures["point"]
    assert failure.error_type == "Incorrect" and "compiled baseline differs" in failure.message
    assert not r.all_correct


def test_controls_are_timed_where_their_answer_is_given(fast_timing):
    r = run(WideLinear.benchmark_job("ci", n_values=[1, 4]), timing=fast_timing, verbose=False, controls=True)
    assert "loop_compiled" not in r.points[0].checks and "loop_compiled" in r.points[1].timings  # the largest N


def test_controls_asked_for_everywhere_are_timed_at_every_point_checked_and_never_win(fast_timing):
    r = run(
        WideLinear.benchmark_job("ci", n_values=[1, 4]),
        timing=fast_timing,
        verbose=False,
        controls=True,
        controls_at="every",
    )
    for p in r.points:
        assert "loop_compiled" in p.timings and p.correct["loop_compiled"]
        assert "loop_graph" not in p.timings  # CUDA only
        assert p.first_call_s["loop_compiled"] > 0
        assert p.winner not in ("loop_compiled", "loop_graph") and p.best_strategy != "loop_compiled"
    assert "loop_compiled (control) ms speedup" in r.summary()
    # a disturbed point or one no strategy wins gets no answer (a loaded CI machine gave one)
    last = r.points[-1]
    answered = last.best_strategy is not None and not last.disturbed
    assert ("fuse, or just make the loop cheaper?" in r.summary()) == answered
    if answered:
        assert r.groups[0].fuse_or_capture.n == 4 and r.groups[0].fuse_or_capture.control == "loop_compiled"
    else:
        assert r.groups[0].fuse_or_capture is None


@pytest.mark.parametrize("mode", ["inference", "forward_backward", "train_step"])
def test_optimizer_controls_step_all_n_models_together_in_train_step_only(mode, fast_timing):
    r = run(
        WideLinear.benchmark_job("ci", n_values=[1, 4]),
        timing=fast_timing,
        verbose=False,
        controls=True,
        controls_at="every",
        mode=mode,
        confirm="none",
    )
    for p in r.points:
        for control in ("loop_foreach", "loop_fused"):
            if mode == "train_step":  # checked (updated parameters included) and timed, never a winner
                assert p.correct[control] and control in p.timings and p.winner != control
            else:  # not run, and not a failure either
                assert control not in p.checks and control not in p.failures
    if mode == "train_step":
        assert "loop_fused: the N calls, all N models stepped by one fused optimizer" in r.summary()


@pytest.mark.slow
def test_controls_are_timed_in_an_isolated_worker_too(fast_timing):
    """The worker names each function it times by its index among those a point may time
    (a control missing there failed every control with a KeyError under --isolate)."""
    r = run(
        WideLinear.benchmark_job("ci", n_values=[2]),
        timing=fast_timing,
        verbose=False,
        controls=True,
        mode="train_step",
        confirm="none",
        isolate=True,
    )
    p = r.points[0]
    assert not {k: f for k, f in p.failures.items() if f.kind != "skipped"}, p.failures
    assert {"loop_compiled", "loop_foreach", "loop_fused"} <= set(p.timings)


@pytest.mark.slow
def test_an_optimizer_control_that_steps_wrong_is_caught(monkeypatch, fast_timing):
    def fused_steps_twice_as_far(params, **implementation):
        return torch.optim.SGD(params, lr=0.02 if implementation.get("fused") else 0.01, momentum=0.9, **implementation)

    monkeypatch.setattr(modes, "OPTIMIZER", fused_steps_twice_as_far)
    r = run(
        WideLinear.benchmark_job("ci", n_values=[4]),
        timing=fast_timing,
        verbose=False,
        controls=True,
        mode="train_step",
        confirm="none",
    )
    p = r.points[0]
    assert p.correct["loop_foreach"] and p.correct["bmm"] and not p.correct["loop_fused"]
    assert p.checks["loop_fused"].error.startswith("updated parameter"), p.checks["loop_fused"].error
    assert "loop_fused" not in p.timings


def test_a_control_faster_than_every_strategy_still_never_wins():
    from wide_tessera.core.correctness import Check
    from wide_tessera.core.stats import TimingStats
    from wide_tessera.measurement.health import Health
    from wide_tessera.measurement.timing import PairedTimings

    def stats(ms):
        return TimingStats.from_samples([ms * (1 + 0.001 * i) for i in range(20)], "cpu_perf_counter")

    timings = PairedTimings(
        {"baseline": stats(10.0), "bmm": stats(5.0), "loop_graph": stats(1.0)},
        Health(rounds=20, disturbed_rounds=0, cleaned=True),
    )
    ok = Check(True, 0.0, 1e-4)
    p = analysis.measured_point(4, {}, timings, {"bmm": ok, "loop_graph": ok})
    assert p.verdicts["loop_graph"] == "faster" and p.winner == "bmm" and p.best_strategy == "bmm"
    versus = analysis.fuse_or_capture(p)
    assert (versus.strategy, versus.control, versus.verdict) == ("bmm", "loop_graph", "slower")
    assert versus.speedup == pytest.approx(0.2, rel=0.01)


def test_strategies_the_run_cannot_give_what_they_need_are_skipped_with_the_reason(fast_timing):
    r = run(GatedLinear.benchmark_job("test"), timing=fast_timing, verbose=False)
    assert r.all_correct, r.failures  # skipped is not incorrect
    for p in r.points:
        assert set(p.timings) == {"baseline", "bmm"} and set(p.correct) == {"bmm"}
        assert {s: f.kind for s, f in p.failures.items()} == dict.fromkeys(
            ("on_cuda", "bf16_only", "probed"), "skipped"
        )
    summary = r.summary()
    assert "on_cuda: needs a CUDA device; this run is on cpu (2 points)" in summary
    assert "bf16_only: needs dtype bfloat16; this point is float32 (2 points)" in summary
    assert "probed: no kernel for torch.float32 on cpu (2 points)" in summary


def test_unmet_need_names_each_missing_capability(monkeypatch):
    assert unmet_need(None, "cpu", torch.float32) is None
    assert unmet_need(Needs(), "cpu", torch.float32) is None
    assert unmet_need(Needs(dtypes=("float32",)), "cpu", torch.float32) is None
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert unmet_need(Needs(triton=True), "cpu", torch.float32) == "needs triton (pip install triton)"


def test_needs_must_be_needs():
    from wide_tessera.core.errors import WideTesseraError

    class Bad(GatedLinear):
        STRATEGY_NEEDS = {"on_cuda": "cuda please"}

    with pytest.raises(WideTesseraError, match="STRATEGY_NEEDS"):
        Bad.check_contract()


@pytest.mark.slow
def test_cli_compile_default_end_to_end_and_resume_refuses_another_mode(tmp_path):
    out = tmp_path / "r.json"
    args = ["benchmark", "gemm", "--preset", "ci", "--n-values", "1,2", "--device", "cpu", "--budget", "0.01"]
    result = CliRunner().invoke(cli, [*args, "--compile", "default", "--no-controls", "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())["results"][0]
    assert saved["settings"]["compile"] == "default" and all(p["first_call_s"]["bmm"] > 0 for p in saved["points"])
    again = CliRunner().invoke(cli, [*args, "-o", str(out), "--resume", "--quiet"])
    assert again.exit_code == 2 and "compile mode default" in again.output


def test_cli_rejects_an_unknown_compile_mode():
    result = CliRunner().invoke(cli, ["benchmark", "gemm", "--compile", "fastest"])
    assert result.exit_code == 2 and "fastest" in result.output


def test_a_strategy_torch_compile_cannot_trace_in_this_dtype_is_skipped_when_compiling():
    needs = Needs(compiled_dtypes=("bfloat16",))
    assert unmet_need(needs, "cpu", torch.float32) is None
    assert unmet_need(needs, "cpu", torch.float32, compiling=True) == (
        "needs dtype bfloat16 under torch.compile; this point is float32"
    )
    assert unmet_need(needs, "cpu", torch.bfloat16, compiling=True) is None
