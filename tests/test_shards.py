"""Sharded sweeps under torchrun: the ranks' points joined into one file, and a rank that raises."""

import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

import wide_tessera as wt
from wide_tessera.cli import cli
from wide_tessera.core.job import point_key

RUN = ["benchmark", "gemm", "layernorm", "--preset", "ci", "--device", "cpu", "--n-values", "1,4", "--budget", "0.01",
       "--target-ci", "0.5"]  # fmt: skip


def torchrun(args, cwd):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "wide_tessera",
        *args,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=180, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def keys(results):
    return {r.op: sorted(point_key(p.n, p.params) for p in r.points) for r in results}


@pytest.mark.slow
def test_two_ranks_write_one_file_with_every_point_once(tmp_path):
    r = torchrun([*RUN, "-o", "sharded.json", "--quiet"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    sharded = wt.load_results(tmp_path / "sharded.json")
    single = CliRunner().invoke(cli, [*RUN, "-o", str(tmp_path / "single.json"), "--quiet"], catch_exceptions=False)
    assert single.exit_code == 0, single.output
    assert keys(sharded) == keys(wt.load_results(tmp_path / "single.json"))  # the same points, each once
    ranks = {r.op: {p.where.rank for p in r.points} for r in sharded}
    assert ranks == {"gemm": {0}, "layernorm": {1}}  # whole groups, one rank each
    for result in sharded:
        assert result.complete and len(result.groups) == 1 and len(result.runs) == 2
        assert all(p.where.host and p.where.device.startswith("cpu") for p in result.points)
    assert sorted(os.listdir(tmp_path)) == ["sharded.json", "sharded.json.lock", "single.json", "single.json.lock"]


@pytest.mark.slow
def test_a_rank_that_raises_loses_no_other_points_and_resume_completes_the_file(tmp_path):
    (tmp_path / "rank_breaker.py").write_text(textwrap.dedent('''
        import os

        if os.environ.get("RANK") == "1":  # rank 1 fails outside any point, as a bug would
            import wide_tessera.sweep.session

            def broken(*args, **kwargs):
                raise RuntimeError("rank 1 broke")

            wide_tessera.sweep.session.run_jobs = broken
    '''))
    r = torchrun([*RUN, "--import", "rank_breaker", "-o", "out.json", "--quiet"], tmp_path)
    assert r.returncode == 1
    assert "rank 1: RuntimeError: rank 1 broke" in r.stderr
    kept, lost = wt.load_results(tmp_path / "out.json")
    assert kept.op == "gemm" and len(kept.points) == 2 and {p.where.rank for p in kept.points} == {0} and kept.complete
    assert lost.op == "layernorm" and not lost.points and not lost.complete  # rank 1's group: to measure again
    # one process can finish what the ranks left, with a rank's thread count (measured alike)
    resume = [sys.executable, "-m", "wide_tessera", *RUN, "-o", "out.json", "--resume", "--threads", "1", "--quiet"]
    resumed = subprocess.run(resume, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = wt.load_results(tmp_path / "out.json")
    assert [r.op for r in done] == ["gemm", "layernorm"] and all(len(r.points) == 2 for r in done)
    assert done[0].points == kept.points  # rank 0's points kept as they were


@pytest.mark.slow
def test_a_rank_that_dies_leaves_its_points_in_its_shard_for_resume(tmp_path):
    (tmp_path / "rank_killer.py").write_text(textwrap.dedent('''
        import os

        if os.environ.get("RANK") == "1":  # rank 1 dies, no teardown, right after saving its first point
            from wide_tessera.results.schema import ResultsFile

            real = ResultsFile.write

            def save_then_die(self, results):
                real(self, results)
                if any(r.points for r in results):
                    os._exit(9)

            ResultsFile.write = save_then_die
    '''))
    r = torchrun([*RUN, "--import", "rank_killer", "-o", "out.json", "--quiet"], tmp_path)
    assert r.returncode != 0 and (tmp_path / "out.json.rank1").exists()  # torchrun stopped the group
    resume = [sys.executable, "-m", "wide_tessera", *RUN, "-o", "out.json", "--resume", "--threads", "1", "--quiet"]
    resumed = subprocess.run(resume, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = {r.op: r for r in wt.load_results(tmp_path / "out.json")}
    assert all(r.complete and len(r.points) == 2 for r in done.values())
    assert done["layernorm"].points[0].where.rank == 1  # measured by the rank that died, kept
    assert not list(tmp_path.glob("out.json.rank*"))  # merged into the file, then removed
