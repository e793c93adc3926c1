"""Results files on disk: symlinks, modes, one writer at a time, interrupts that leave a loadable file."""

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from wide_tessera import DispatchTable, entry, load_results, save_results
from wide_tessera.cli import cli
from wide_tessera.cli import measure as measure_commands
from wide_tessera.core.files import lock_path, results_lock
from wide_tessera.core.jsonio import json_text
from wide_tessera.results.schema import ResultsFile
from wide_tessera.sweep.progress import Progress

ROOT = Path(__file__).resolve().parent.parent
RUN = ["benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--n-values", "1", "--quiet"]
FAST = ["--budget", "0.001", "--target-ci", "0.5"]


@pytest.fixture
def results(saved_results):
    return load_results(saved_results)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_the_mode_the_umask_gives(tmp_path, results, umask_022):
    save_results(results, tmp_path / "r.json")
    assert mode(tmp_path / "r.json") == 0o644


def test_a_new_file_follows_a_stricter_umask(tmp_path, results):
    old = os.umask(0o077)
    try:
        save_results(results, tmp_path / "r.json")
    finally:
        os.umask(old)
    assert mode(tmp_path / "r.json") == 0o600


def test_an_existing_file_keeps_its_mode(tmp_path, results, umask_022):
    path = tmp_path / "r.json"
    save_results(results[:1], path)
    path.chmod(0o640)
    save_results(results, path)
    assert mode(path) == 0o640 and load_results(path) == results


def test_a_ctrl_c_just_after_the_rename_is_the_interrupt_and_the_file_is_whole(tmp_path, results, monkeypatch):
    replace = os.replace

    def replace_then_interrupt(src, dst):
        replace(src, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_results(results, tmp_path / "r.json")
    monkeypatch.undo()
    assert load_results(tmp_path / "r.json")[0].op == results[0].op
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_symlink_is_written_through_to_its_target(tmp_path, results):
    target, link = tmp_path / "data" / "r.json", tmp_path / "link.json"
    target.parent.mkdir()
    save_results([], target)  # stale: no results yet
    link.symlink_to(target)
    save_results(results, link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert load_results(target) == results  # the target is fresh, not left stale
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.json"]  # the temporary file went beside it


def test_a_file_written_after_every_point_encodes_only_the_result_that_changed(tmp_path, results, monkeypatch):
    encoded = []
    to_dict = type(results[0]).to_dict
    monkeypatch.setattr(type(results[0]), "to_dict", lambda self: encoded.append(self.op) or to_dict(self))
    file = ResultsFile(tmp_path / "r.json")
    file.write(results)
    assert encoded == [r.op for r in results]
    changed = dataclasses.replace(results[1], points=results[1].points[:1])
    file.write([results[0], changed])
    assert encoded == [r.op for r in results] + [changed.op]  # the unchanged result was not encoded again
    assert [len(r.points) for r in load_results(tmp_path / "r.json")] == [len(results[0].points), 1]


def test_a_result_that_gains_a_point_encodes_only_that_point_and_writes_what_a_full_encoding_would(
    tmp_path, results, monkeypatch
):
    encoded = []
    point_type = type(results[0].points[0])
    to_dict = point_type.to_dict
    monkeypatch.setattr(point_type, "to_dict", lambda self: encoded.append(self.n) or to_dict(self))
    first = dataclasses.replace(results[0], points=results[0].points[:1])
    file = ResultsFile(tmp_path / "r.json")
    file.write([first])
    assert len(encoded) == 1
    file.write([results[0]])  # the same first point, and the others
    assert len(encoded) == len(results[0].points)
    monkeypatch.setattr(point_type, "to_dict", to_dict)
    whole = json.loads((tmp_path / "r.json").read_text())["results"]
    assert len(results[0].points) > 1 and whole == [json.loads(json_text("r.json", results[0].to_dict()))]


def test_the_cli_writes_through_a_symlink_and_locks_its_target(tmp_path):
    target, link = tmp_path / "r.json", tmp_path / "link.json"
    link.symlink_to(target)  # dangling until the first save
    r = CliRunner().invoke(cli, [*RUN, *FAST, "-o", str(link)])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and [x.op for x in load_results(target)] == ["gemm"]
    assert lock_path(link) == tmp_path / "r.json.lock"


def test_a_fifo_is_refused_before_anything_is_measured(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = CliRunner().invoke(cli, [*RUN, "-o", str(fifo)])
    assert r.exit_code == 2 and "is a FIFO, not a results file" in r.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert "[gemm]" not in r.output  # nothing was measured


def test_a_symlink_to_a_device_is_refused(tmp_path, results):
    link = tmp_path / "full.json"
    link.symlink_to("/dev/full")
    r = CliRunner().invoke(cli, [*RUN, "-o", str(link)])
    assert r.exit_code == 2 and "is a character device" in r.output
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_a_second_run_on_a_locked_file_exits_2_naming_the_holder(tmp_path):
    out = tmp_path / "r.json"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom wide_tessera.core.files import results_lock\n"
            "with results_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        r = CliRunner().invoke(cli, [*RUN, *FAST, "-o", str(out)])
    finally:
        holder.kill()
        holder.communicate()
    assert r.exit_code == 2, r.output
    assert f"{out}: PID {holder.pid} (" in r.output and "is writing it" in r.output
    assert not out.exists()  # refused before measuring, nothing written
    # The holder's death frees the file.
    assert CliRunner().invoke(cli, [*RUN, *FAST, "-o", str(out)]).exit_code == 0


def test_the_lock_is_released_after_the_run_and_on_errors(tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(ZeroDivisionError):
        with results_lock(out):
            raise ZeroDivisionError
    with results_lock(out):
        pass
    assert lock_path(out).read_text().strip() == str(os.getpid())


def cli_process(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "wide_tessera", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_ctrl_c_while_jobs_are_built_exits_130_without_a_traceback(monkeypatch, capsys, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(measure_commands, "build_jobs", interrupted)
    monkeypatch.setattr(sys, "argv", ["wide_tessera", *RUN, "-o", str(tmp_path / "r.json")])
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert entry.run() == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow
def test_two_quick_ctrl_cs_exit_130_and_leave_a_loadable_file(tmp_path):
    out = tmp_path / "r.json"
    proc = cli_process(*RUN[:-3], "--n-values", "1,2,3,4,5,6", "-o", str(out))
    deadline = time.monotonic() + 120
    while not out.exists() and time.monotonic() < deadline:  # the file appears after the first point
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    (partial,) = load_results(out)
    assert not partial.complete


def test_ctrl_c_while_torch_is_still_loading_exits_130_without_a_traceback():
    proc = subprocess.Popen(
        [sys.executable, "-m", "wide_tessera", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.3)  # inside the imports: torch alone takes over a second on the CI machine
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err


def test_a_dispatch_table_is_locked_by_each_merge_not_by_the_whole_run(tmp_path, monkeypatch):
    """A run that saves to a table leaves it free between merges, so that a first call in another
    process can write its measurement meanwhile (it waits for a merge, not for the run)."""
    table = tmp_path / "t.json"
    free = []
    done = Progress.done

    def done_and_lock(self, line):
        with results_lock(table):  # fails at once where the run holds the table
            free.append(line)
        done(self, line)

    monkeypatch.setattr(Progress, "done", done_and_lock)
    r = CliRunner().invoke(cli, [*RUN, *FAST, "--n-values", "1,2", "--save-dispatch", str(table)])
    assert r.exit_code == 0, r.output
    assert free and DispatchTable.load(table).entries


@pytest.mark.parametrize(
    "stop_in, said",
    [("[gemm]", "no op had finished"), ("[layernorm]", "no op had finished"), ("[layernorm] confirm", "gemm")],
)
def test_an_interrupted_tune_names_the_ops_that_reached_the_table(stop_in, said, tmp_path, monkeypatch):
    """It said 'the ops finished before it are in the dispatch table' when none had: every op's
    first pass runs before any is confirmed, so an op stopped in its first pass leaves none."""
    table = tmp_path / "t.json"
    done = Progress.done

    def interrupt_in(self, line):
        if line.startswith(stop_in):
            raise KeyboardInterrupt
        done(self, line)

    monkeypatch.setattr(Progress, "done", interrupt_in)
    args = ["tune", "gemm", "layernorm", "--preset", "ci", "--n-values", "1", "-o", str(table), "--budget", "0.001"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 130 and f"in the dispatch table {table}: {said}" in r.output, r.output
