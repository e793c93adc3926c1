"""One settings object: declared once, taken alike by the API and the command line, checked by
--resume without being told, and kept in the results file (old files included)."""

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import wide_tessera as wt
from wide_tessera.cli import cli
from wide_tessera.core.environment import capture_environment
from wide_tessera.core.errors import WideTesseraError
from wide_tessera.measurement.settings import RunSettings
from wide_tessera.sweep.resume import check_resumable

from .helpers import Expert

GOLDEN = Path(__file__).parent / "golden"

# A value other than the default for every setting --resume refuses to change. A new setting
# marked `resume` fails the first test until it has one here, and is then refused like these.
CHANGED = {
    "preset": "quick",
    "seed": 1,
    "mode": "forward",
    "compile": "default",
    "energy": True,
    "timing": wt.TimingConfig(budget_s=0.3),
    "precise": True,
    "regret": 0.05,
}


def test_every_setting_that_changes_a_measurement_is_refused_by_resume(fast_timing):
    result = wt.benchmark("gemm", preset="ci", device="cpu", verbose=False, n_values=[1], timing=fast_timing)
    env = capture_environment("cpu")
    assert {name for name, _ in result.settings.resumable_as()} == set(CHANGED)
    check_resumable(result, "r.json", result.settings, env)  # the same settings continue
    for name, value in CHANGED.items():
        with pytest.raises(WideTesseraError, match="r.json has gemm measured with .*; this run asks for"):
            check_resumable(result, "r.json", dataclasses.replace(result.settings, **{name: value}), env)
    # the others may change between the runs of one file: they do not change what is measured
    free = dataclasses.replace(result.settings, isolate=True, memory_budget=2**30, confirm="all", roofline=True)
    check_resumable(result, "r.json", free, env)


@pytest.mark.slow
def test_the_api_and_the_command_line_build_the_same_settings(tmp_path, fast_timing):
    out = tmp_path / "r.json"
    args = ["benchmark", "gemm", "--preset", "ci", "--n-values", "1", "--device", "cpu", "--seed", "3"]
    assert (
        CliRunner().invoke(cli, [*args, "--mode", "forward", "--confirm", "all", "-o", str(out), "--quiet"]).exit_code
        == 0
    )
    (from_cli,) = wt.load_results(out)
    from_api = wt.benchmark(
        "gemm", preset="ci", device="cpu", verbose=False, n_values=[1], seed=3, mode="forward", confirm="all"
    )
    assert from_cli.settings == from_api.settings
    assert from_api.settings == RunSettings(preset="ci", device="cpu", seed=3, mode="forward", confirm="all")


@pytest.mark.slow
def test_benchmark_custom_takes_every_run_setting_and_keeps_the_models_arguments_apart(fast_timing):
    r = wt.benchmark_custom(
        Expert,
        (4, 16),
        [2],
        model_kwargs=dict(hidden=8),
        device="cpu",
        verbose=False,
        timing=fast_timing,
        roofline=True,
    )
    assert r.settings.roofline and r.peaks is not None
    with pytest.raises(WideTesseraError, match="hidden=8 is not a run setting"):
        wt.benchmark_custom(Expert, (4, 16), [2], hidden=8)


def test_a_results_file_of_schema_6_loads_with_its_settings_in_one_object():
    gemm, layernorm = wt.load_results(GOLDEN / "schema6.json")
    assert (gemm.preset, gemm.seed, gemm.mode, gemm.compile, gemm.confirm) == ("ci", 0, "inference", "none", "all")
    assert (layernorm.mode, layernorm.confirm) == ("forward", "none")
    assert not gemm.measured_energy and gemm.timing.budget_s == 0.01
    assert "crossover_n" in gemm.summary()


def test_a_file_measured_before_regret_bounds_keeps_the_rule_it_was_decided_by(tmp_path, fast_timing):
    """Its settings hold no regret: None, not today's default, so that it renders and is
    re-analysed by its marginal zone (results.decisions), and a --resume of it is refused."""
    (gemm, _) = wt.load_results(GOLDEN / "schema6.json")
    assert gemm.settings.regret is None and "marginal: within 1.029..1.071" in gemm.summary()
    path = tmp_path / "r.json"
    wt.benchmark("gemm", preset="ci", device="cpu", verbose=False, n_values=[1], timing=fast_timing).save(path)
    doc = json.loads(path.read_text())
    assert doc["results"][0]["settings"]["regret"] == 0.02
    del doc["results"][0]["settings"]["regret"]
    path.write_text(json.dumps(doc))
    (before,) = wt.load_results(path)
    assert before.settings.regret is None and "marginal: within" in before.summary()
