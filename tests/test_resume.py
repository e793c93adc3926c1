"""--resume: every result and point already in the file is kept, only what is missing is measured,
and a file measured under other settings is refused."""

import json

import pytest
import torch
from click.testing import CliRunner

from wide_tessera import SweepParams, load_results
from wide_tessera.cli import cli
from wide_tessera.core.job import point_key
from wide_tessera.sweep.resume import point_order

FAST = ["--budget", "0.001", "--target-ci", "0.5", "--device", "cpu", "--preset", "ci", "--quiet"]


@pytest.fixture(autouse=True)
def _threads_restored():
    threads = torch.get_num_threads()  # --threads sets them for this whole process
    yield
    torch.set_num_threads(threads)


def bench(out, *args, resume=False):
    return CliRunner().invoke(cli, ["benchmark", *args, *FAST, "-o", str(out), *(["--resume"] if resume else [])])


def timings(result):
    return {(p.n, json.dumps(p.params, sort_keys=True)): p.timings for p in result.points}


@pytest.fixture
def gemm_file(tmp_path):
    out = tmp_path / "r.json"
    assert bench(out, "gemm", "--n-values", "1").exit_code == 0
    return out


def test_resuming_with_another_op_keeps_the_first(gemm_file):
    (gemm,) = load_results(gemm_file)
    r = bench(gemm_file, "conv1d", "--n-values", "1", resume=True)
    assert r.exit_code == 0, r.output
    kept, conv = load_results(gemm_file)
    assert (kept.op, conv.op) == ("gemm", "conv1d") and kept == gemm
    assert "wrote 2 result(s)" in r.output


def test_new_n_values_are_measured_and_earlier_points_kept(gemm_file):
    (before,) = load_results(gemm_file)
    assert before.complete
    r = bench(gemm_file, "gemm", "--n-values", "2,4", resume=True)
    assert r.exit_code == 0, r.output
    (after,) = load_results(gemm_file)
    assert [p.n for p in after.points] == [1, 2, 4] and after.complete
    assert after.points[0].timings == before.points[0].timings  # kept, not measured again
    assert [g.n_values for g in after.groups] == [[1, 2, 4]]


def test_new_axis_values_are_measured_and_earlier_points_kept(gemm_file):
    (before,) = load_results(gemm_file)
    r = bench(gemm_file, "gemm", "--n-values", "1", "--set", "batch=16,32", resume=True)
    assert r.exit_code == 0, r.output
    (after,) = load_results(gemm_file)
    assert [(p.n, p.params["batch"]) for p in after.points] == [(1, 16), (1, 32)]
    assert timings(after).items() >= timings(before).items()


def test_a_complete_file_with_nothing_missing_is_left_as_it_is(gemm_file):
    (before,) = load_results(gemm_file)
    r = bench(gemm_file, "gemm", "--n-values", "1", resume=True)
    assert r.exit_code == 0, r.output
    assert load_results(gemm_file) == [before]
    assert r.output.count("== gemm (preset ci)") == 1  # its answer is still printed


def test_an_op_and_its_alias_run_once(tmp_path):
    out = tmp_path / "r.json"
    r = bench(out, "gemm", "linear", "gemm", "--n-values", "1")
    assert r.exit_code == 0, r.output
    assert [x.op for x in load_results(out)] == ["gemm"] and r.output.count("== gemm") == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--seed", "7"], "measured with seed 0; this run asks for seed 7"),
        (["--threads", "1"], "measured with threads 2; this run asks for threads 1"),
        (["--budget", "0.002"], "measured with timing budget_s=0.001; this run asks for timing budget_s=0.002"),
        (["--target-ci", "0.4"], "timing target_rel_ci=0.5; this run asks for timing target_rel_ci=0.4"),
    ],
)
@pytest.mark.slow
def test_a_file_measured_with_other_settings_is_refused(tmp_path, args, message):
    out = tmp_path / "r.json"
    assert bench(out, "gemm", "--n-values", "1", "--threads", "2").exit_code == 0
    before = out.read_text()
    r = CliRunner().invoke(
        cli, ["benchmark", "gemm", "--n-values", "2", "--threads", "2", *FAST, *args, "-o", str(out), "--resume"]
    )
    assert r.exit_code == 2, r.output
    assert message in r.output and f"--resume: {out} has gemm" in r.output
    assert out.read_text() == before  # refused before anything was measured or written


@pytest.mark.parametrize(
    "field,value",
    [
        ("device_name", "Another CPU"),
        ("torch_version", "1.0.0"),
        ("triton_version", "0.1"),
        ("python_version", "3.9.1"),
    ],
)
def test_a_file_from_another_machine_or_torch_is_refused(gemm_file, field, value):
    doc = json.loads(gemm_file.read_text())
    doc["results"][0]["environment"][field] = value
    gemm_file.write_text(json.dumps(doc))
    r = bench(gemm_file, "gemm", "--n-values", "2", resume=True)
    assert r.exit_code == 2 and f"measured with {field.replace('_version', '').replace('_', ' ')} {value}" in r.output


def test_point_order_puts_added_n_values_in_place_and_new_groups_after():
    sweep = SweepParams.of([8, 2], batch=[16, 32])
    earlier = [type("P", (), {"n": n, "params": {"batch": b}})() for n, b in [(4, 32), (1, 32)]]
    order = point_order(sweep, earlier)
    ranked = sorted(order, key=order.get)
    expected = [(1, 32), (2, 32), (4, 32), (8, 32), (2, 16), (8, 16)]
    assert ranked == [point_key(n, {"batch": b}) for n, b in expected]
