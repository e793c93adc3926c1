"""The collectives benchmark: nccl-tests' bandwidths, the correctness check, and a real 2-rank gloo run."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from wide_tessera.cli import cli
from wide_tessera.collectives import cases as collectives
from wide_tessera.collectives.cases import (
    COLLECTIVES,
    CollectivesRun,
    algbw_gbps,
    busbw_factor,
    expected,
    run_case,
    sizes,
)
from wide_tessera.measurement.timing import TimingConfig


def test_bandwidths_follow_nccl_tests():
    # doc/PERFORMANCE.md of nccl-tests: 1 GB all_reduced over 8 ranks in 0.1 s is algbw 10 GB/s, busbw 17.5 GB/s
    assert algbw_gbps(10**9, 0.1) == pytest.approx(10.0)
    factors = {
        "all_reduce": 2 * 7 / 8,
        "all_gather": 7 / 8,
        "reduce_scatter": 7 / 8,
        "all_to_all": 7 / 8,
        "broadcast": 1.0,
    }
    for op, factor in factors.items():
        assert busbw_factor(op, 8) == pytest.approx(factor)
    assert algbw_gbps(10**9, 0.1) * busbw_factor("all_reduce", 8) == pytest.approx(17.5)
    assert busbw_factor("all_reduce", 1) == 0.0  # one rank moves nothing over a link
    assert sizes(1000, 8192) == [1024, 2048, 4096, 8192]


def test_the_expected_results_tell_a_wrong_collective():
    f32 = torch.float32
    total = expected("all_reduce", 8, 4, 0, f32, "cpu")
    missing_one = sum(collectives._values(8, r, f32, "cpu") for r in range(3))
    assert not torch.equal(total, missing_one)
    a2a = expected("all_to_all", 8, 2, 1, f32, "cpu")  # rank 1 gets chunk 1 of ranks 0 and 1
    assert torch.equal(
        a2a, torch.cat([collectives._values(8, 0, f32, "cpu")[4:], collectives._values(8, 1, f32, "cpu")[4:]])
    )
    gathered = expected("all_gather", 8, 2, 0, f32, "cpu")
    assert not torch.equal(
        gathered, torch.cat([collectives._values(8, 1, f32, "cpu")[:4], collectives._values(8, 0, f32, "cpu")[:4]])
    )


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_collective_that_computes_the_wrong_thing_is_incorrect(monkeypatch):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        fast = TimingConfig(budget_s=0.01, min_samples=3)
        assert run_case("all_gather", 1024, "float32", "out_of_place", "cpu", fast).correct
        monkeypatch.setattr(collectives, "_ALL_GATHER", lambda out, inp: out.copy_(inp.flip(0)))
        wrong = run_case("all_gather", 1024, "float32", "out_of_place", "cpu", fast)
        assert wrong.correct is False and "differs" in wrong.error
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_under_torchrun_check_and_time_every_collective(tmp_path):
    out = tmp_path / "coll.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "wide_tessera", "collectives", "--device", "cpu", "--max-bytes", "2KiB", "--budget", "0.01",
               "-o", str(out), "--quiet"]  # fmt: skip
    r = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "busbw GB/s" in r.stdout and "2 ranks, gloo" in r.stdout
    run = CollectivesRun.from_dict(json.loads(out.read_text()))
    assert run.ranks == 2 and len(run.hosts) == 2 and run.manifest.finished
    assert {r.op for r in run.results} == set(COLLECTIVES)
    placements = {(r.op, r.placement) for r in run.results}
    assert ("all_gather", "in_place") in placements and ("reduce_scatter", "out_of_place") in placements
    for result in run.results:
        assert result.correct is True, result
        assert result.size_bytes in (1024, 2048) and result.stats.n_samples >= 3
        assert result.busbw_gbps == pytest.approx(result.algbw_gbps * busbw_factor(result.op, 2))
        assert result.algbw_gbps == pytest.approx(result.size_bytes / (result.stats.median_ms / 1e3) / 1e9)
    shown = CliRunner().invoke(cli, ["show", str(out), "--format", "csv"], catch_exceptions=False)
    assert shown.exit_code == 0 and shown.output.startswith("op,placement,dtype,size_bytes")
    assert len(shown.output.splitlines()) == 1 + len(run.results)
    pytest.importorskip("matplotlib")
    drawn = CliRunner().invoke(cli, ["plot", str(out), "-o", str(tmp_path / "plots")], catch_exceptions=False)
    assert drawn.exit_code == 0 and (tmp_path / "plots" / "collectives_float32_in_place.png").exists()
    out.write_text(out.read_text()[:-200])  # cut short
    damaged = CliRunner().invoke(cli, ["show", str(out)])
    assert damaged.exit_code == 2 and str(out) in damaged.output and "Traceback" not in damaged.output


def test_outside_torchrun_is_one_line(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    r = CliRunner().invoke(cli, ["collectives"])
    assert r.exit_code == 2 and "runs under torchrun" in r.output and "Traceback" not in r.output
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    r = CliRunner().invoke(cli, ["collectives", "--ops", "allreduce"])
    assert r.exit_code == 2 and "unknown collective 'allreduce'; did you mean 'all_reduce'?" in r.output
