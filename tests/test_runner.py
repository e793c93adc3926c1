"""The generic runner: distinct models, correctness first, wrong strategies caught and reported."""

import sys
from typing import List

import pytest
import torch
from torch import nn

from wide_tessera import register
from wide_tessera.core.errors import Interrupted
from wide_tessera.measurement.health import HealthMonitor
from wide_tessera.measurement.settings import RunSettings
from wide_tessera.ops import WideLinear
from wide_tessera.ops.registry import REGISTRY
from wide_tessera.reports.brief import closing_table
from wide_tessera.results import passes
from wide_tessera.results.load import load_results
from wide_tessera.results.schema import PointResult, ResultsFile
from wide_tessera.sweep.progress import Progress
from wide_tessera.sweep.runner import JobRun, run, run_jobs
from wide_tessera.sweep.session import measure_jobs

from .helpers import SometimesWrongLinear


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """The runner's passes are tested on a quiet machine: on a busy one (CI's, once) an op whose
    first two points are disturbed stops before its confirmations, which is not what is tested
    here. The tests of a disturbed run say so themselves."""
    monkeypatch.setattr(HealthMonitor, "round_disturbed", lambda self: False)


@pytest.fixture
def wrong_op():
    register("test_sometimes_wrong")(SometimesWrongLinear)
    yield SometimesWrongLinear
    del REGISTRY["test_sometimes_wrong"]


def test_wrong_and_raising_strategies_are_reported_and_never_win(wrong_op, fast_timing):
    r = run(wrong_op.benchmark_job("test"), timing=fast_timing, verbose=False)
    for p in r.points:
        assert p.correct == {"bmm": True, "wrong": False, "raises": False}
        assert p.best_strategy == "bmm"
        assert set(p.timings) == {"baseline", "bmm"}  # incorrect strategies are not timed
        assert "exceeds tolerance" in p.checks["wrong"].error
        failure = p.failures["raises"]
        assert (failure.stage, failure.kind, failure.error_type, failure.message) == (
            "check",
            "error",
            "RuntimeError",
            "kernel exploded",
        )
    assert set(r.strategy_wins) <= {"bmm", "baseline", "no_difference", "marginal", "open", "unstable"}
    assert not r.all_correct and len(r.failures) == 6


def test_baseline_uses_n_distinct_models_with_distinct_inputs(fast_timing):
    built: List[nn.Module] = []
    job = WideLinear.benchmark_job("ci", n_values=[3])
    factory = job.model_factory

    def recording_factory(**params):
        built.append(factory(**params))
        return built[-1]

    job.model_factory = recording_factory
    inputs_seen = []
    make_inputs = job.input_factory
    job.input_factory = lambda n, **p: inputs_seen.append(make_inputs(n, **p)) or inputs_seen[-1]
    run(job, timing=fast_timing, verbose=False, confirm="none")
    assert len(built) == 3
    assert not torch.equal(built[0].weight, built[1].weight)
    assert len(inputs_seen[0]) == 3 and not torch.equal(inputs_seen[0][0], inputs_seen[0][1])


def test_same_seed_same_models_and_verdicts(fast_timing):
    job = WideLinear.benchmark_job("ci", n_values=[2])
    a = run(job, seed=7, timing=fast_timing, verbose=False)
    b = run(job, seed=7, timing=fast_timing, verbose=False)
    assert [p.checks for p in a.points] == [p.checks for p in b.points]


def test_progress_goes_to_stderr_and_quiet_silences_it(capsys, fast_timing):
    job = WideLinear.benchmark_job("ci", n_values=[2])
    run(job, timing=fast_timing, verbose=True)
    out, err = capsys.readouterr()
    assert out == "" and "[gemm] 1/1 N=2" in err
    run(job, timing=fast_timing, verbose=False)
    assert capsys.readouterr() == ("", "")


def test_result_records_where_and_how_it_was_measured(fast_timing):
    r = run(WideLinear.benchmark_job("ci", n_values=[2]), timing=fast_timing, verbose=False)
    env = r.environment
    assert (env.device, r.timer) == ("cpu", "cpu_perf_counter")
    assert env.torch_version == torch.__version__ and env.threads == torch.get_num_threads()
    assert r.duration_s > 0 and env.device_name


def test_every_job_is_measured_before_any_is_confirmed(fast_timing, capsys):
    """A point's confirmation is taken a run after its first pass, not seconds after, so that a
    machine state that lasts seconds is not measured twice (runner.run_jobs)."""
    settings = RunSettings(preset="ci", device="cpu", timing=fast_timing, confirm="all")
    jobs = [REGISTRY[op].benchmark_job("ci", n_values=[1, 2]) for op in ("gemm", "layernorm")]
    progress = Progress(0, stream=sys.stderr)
    results = list(run_jobs([JobRun(job, settings, progress=progress) for job in jobs]))
    lines = capsys.readouterr().err.splitlines()
    # a later pass is a confirmation, or the third pass of a point whose two passes disagreed
    # (a busy machine can make one UNSTABLE: it too comes after every first pass)
    later = [i for i, line in enumerate(lines) if " confirm " in line or " third pass " in line]
    firsts = [i for i in range(len(lines)) if i not in later]
    assert later and max(firsts) < min(later), lines
    assert [r.op for r in results] == ["gemm", "layernorm"] and all(r.complete for r in results)
    assert all(p.confirmation is not None for r in results for p in r.points if p.timings)
    assert all(0 < r.duration_s < sum(x.duration_s for x in results) for r in results)  # each job's own time


def test_an_op_whose_first_points_are_all_disturbed_stops_and_says_why(fast_timing, monkeypatch):
    """Beside 2 to 4 busy threads on 2 cores the quick preset took 15 min for 14 DISTURBED ops: an op
    whose first 2 points are all disturbed stops there, incomplete (--resume measures the rest),
    unreliable with the remedy as its first reason, and nothing of it is confirmed."""
    monkeypatch.setattr(HealthMonitor, "round_disturbed", lambda self: True)
    job = WideLinear.benchmark_job("ci", n_values=[1, 2, 4, 8])
    r = run(job, timing=fast_timing, verbose=False)
    assert len(r.points) == 2 and all(p.disturbed and p.confirmation is None for p in r.points)
    assert not r.complete and not r.reliable
    assert r.unreliable_reasons[0].startswith("stopped after its first 2 points, all disturbed")
    assert "--threads" in r.unreliable_reasons[0] and "INCOMPLETE, UNRELIABLE: stopped" in r.brief()  # the remedy
    assert "INCOMPLETE (its answer above says why)" in closing_table([r])
    short = run(WideLinear.benchmark_job("ci", n_values=[1, 2, 4]), timing=fast_timing, verbose=False)
    assert len(short.points) == 3 and short.complete  # too little left to be worth stopping


def test_a_resumed_run_gives_its_earlier_disputed_points_their_third_pass(fast_timing, capsys, monkeypatch):
    """A run interrupted after its confirmations measured no third pass, and --resume lost the two
    passes it needs: a point left disputed stayed so. Its passes are rebuilt from the file.
    The first run's passes agree, as if it were interrupted before a third: on a busy machine (CI's,
    once) both points were disputed, took their third pass, and left the resume none to give."""
    settings = RunSettings(preset="ci", device="cpu", timing=fast_timing, confirm="all")
    job = WideLinear.benchmark_job("ci", n_values=[1, 2])
    monkeypatch.setattr(passes, "disputed", lambda first, second: False)
    (earlier,) = run_jobs([JobRun(job, settings)])
    confirmed = [p.n for p in earlier.points if passes.stored_passes(p) is not None]
    monkeypatch.setattr(passes, "disputed", lambda first, second: True)
    capsys.readouterr()
    list(run_jobs([JobRun(job, settings, earlier, progress=Progress(0, stream=sys.stderr))]))
    thirds = [line for line in capsys.readouterr().err.splitlines() if " third pass " in line]
    assert confirmed == [1, 2] and len(thirds) == 2, thirds


def test_a_ctrl_c_during_a_confirmation_saves_and_names_every_job_measured_so_far(fast_timing, tmp_path):
    """The first passes of the jobs after the one stopped are in the file too, and the message says so."""

    class StopAtConfirmation(Progress):
        def done(self, line):
            if " confirm " in line:
                raise KeyboardInterrupt
            super().done(line)

    settings = RunSettings(preset="ci", device="cpu", timing=fast_timing, confirm="all")
    jobs = [REGISTRY[op].benchmark_job("ci", n_values=[1, 2]) for op in ("gemm", "layernorm")]
    out = tmp_path / "r.json"
    with pytest.raises(Interrupted) as stop:
        measure_jobs(jobs, settings, {}, str(out), StopAtConfirmation(0, enabled=False), lambda r: None)
    saved = {r.op: r for r in load_results(out)}
    assert set(saved) == {"gemm", "layernorm"} and not any(r.complete for r in saved.values())
    assert str(stop.value) == (
        f"saved {len(saved['gemm'].points)} point(s) of gemm, {len(saved['layernorm'].points)} of layernorm to {out}"
    )


def test_a_run_saved_after_every_point_encodes_each_point_once_it_is_analysed(fast_timing, monkeypatch, tmp_path):
    """The results file is written after every point and encodes each point object once: a run
    whose analysis made new copies of every point at every write encoded the whole op again each
    time, growing with the square of its points. A quiet machine: on a busy one the op stops
    after two disturbed points, which is not what is tested here (see _quiet_machine)."""
    encoded = []
    to_dict = PointResult.to_dict
    monkeypatch.setattr(PointResult, "to_dict", lambda self: encoded.append(self.n) or to_dict(self))
    settings = RunSettings(preset="ci", device="cpu", timing=fast_timing, confirm="none")
    job = WideLinear.benchmark_job("ci", n_values=[1, 2, 4, 8, 16, 32])
    written = []
    file = ResultsFile(tmp_path / "r.json")
    (result,) = run_jobs([JobRun(job, settings, on_point=lambda r: written.append(file.write([r])))])
    assert len(written) == len(result.points) == 6
    # each point when measured, and again only where a later point changed what it feeds: not
    # every point measured so far at every write (1 + 2 + ... + 6)
    assert len(encoded) < 6 * 7 // 2, encoded


def test_a_run_leaves_the_callers_random_generator_as_it_was(fast_timing):
    job = WideLinear.benchmark_job("ci", n_values=[2], in_features=[8], out_features=[8], batch=[4])
    torch.manual_seed(5)
    before = torch.get_rng_state()
    run(job, timing=fast_timing, verbose=False, memory_budget=2**30)
    assert torch.equal(torch.get_rng_state(), before)
