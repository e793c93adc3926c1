"""What an adversary tried (issue 31, item 6), one case per row: one line, the right exit status,
nothing lost. CLI rows run the real command line; API rows call the library."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import wide_tessera as wt
from wide_tessera.cli import cli
from wide_tessera.dispatch.build import LoopedModules
from wide_tessera.dispatch.table import DispatchTable, entries_of
from wide_tessera.ops.gemm import WideLinear
from wide_tessera.widen.functional import WideFunctional
from wide_tessera.widen.surgery import WideSurgery

from .helpers import Expert, entry

GEMM = ["benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--n-values", "1", "--budget", "0.005", "--quiet"]


@pytest.fixture
def places(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    results = tmp_path / "r.json"
    CliRunner().invoke(cli, [*GEMM, "-o", str(results)])
    bad_module = tmp_path / "exits.py"
    bad_module.write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "lazy.py").write_text("def __getattr__(name):\n    raise RuntimeError('boom')\n")
    (tmp_path / "factories.py").write_text(
        "import sys, itertools, torch\n"
        "def quits():\n    sys.exit(0)\n"
        "rows = itertools.count(2)\n"
        "def grows():\n    return torch.randn(next(rows), 16)\n"
        "class Quits(torch.nn.Module):\n    def __init__(self):\n        sys.exit(0)\n"
    )
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    table = tmp_path / "table.json"
    DispatchTable().save(table)
    damaged = json.loads(json.dumps(DispatchTable([entry()]).to_dict()))
    damaged["entries"][0]["verdicts"][1]["speedup_ci"] = [3.0]
    (tmp_path / "damaged.json").write_text(json.dumps(damaged))
    user = tmp_path / "docs"  # a folder of the user's, with a README of theirs
    user.mkdir()
    (user / "README.md").write_text("# my project\n")
    return {
        "tmp": str(tmp_path),
        "blocker": str(blocker),
        "results": str(results),
        "long": "x" * 300,
        "notes": str(notes),
        "table": str(table),
        "user": str(user),
        "damaged": str(tmp_path / "damaged.json"),
    }


CLI_CASES = [
    # output paths the OS refuses
    (["plot", "{results}", "-o", "{blocker}/plots"], "cannot write there: {blocker} is not a directory"),
    (["report", "{results}", "-o", "{blocker}/report"], "cannot write there: {blocker} is not a directory"),
    (["tune", "gemm", "--preset", "ci", "--n-values", "1", "-o", "{tmp}/{long}.json"], "the file name is longer than"),
    ([*GEMM, "--trace", "{blocker}"], "--trace {blocker}: exists and is not a directory"),
    ([*GEMM, "--trace", "{blocker}/tr"], "--trace {blocker}/tr: cannot write there: {blocker} is not a directory"),
    ([*GEMM, "--dump-ir", "{blocker}/ir"], "--dump-ir {blocker}/ir: cannot write there: {blocker} is not a directory"),
    # --trace-n that would trace nothing (issue 50, cause 5)
    ([*GEMM, "--trace-n", "1"], "--trace-n [1]: traces are written only where trace (--trace) names a folder"),
    ([*GEMM, "--trace", "{tmp}/tr", "--trace-n", "3"], "--trace-n 3: this run measures no such N (its N values: 1)"),
    ([*GEMM, "--trace", "{tmp}/tr", "--trace-n", "99999999999999999999"], "--trace-n 99999999999999999999: this run"),
    # empty paths are not "not given"
    (["tune", "gemm", "--preset", "ci", "--n-values", "1", "-o", ""], "'': give a file name"),
    ([*GEMM, "--save-dispatch", ""], "'': give a file name"),
    (["plot", "{results}", "-o", ""], "-o '': give a folder name"),
    (["tune", "gemm", "--preset", "ci", "--n-values", "1", "--results", ""], "--results '': give a file name"),
    # values that cannot be right
    ([*GEMM, "--memory-budget", "0.0000001"], "expected a size of at least one byte"),
    (
        [
            "custom",
            "tests.helpers:Expert",
            "--input-shape",
            "2,16",
            "--n-values",
            "2",
            "--kwarg",
            "d=16",
            "--kwarg",
            "d=32",
        ],
        "--kwarg d is given twice",
    ),
    # an imported module that calls sys.exit is an import that failed, not an exit status of ours
    (["benchmark", "--import", "exits", "gemm"], "cannot import 'exits': SystemExit: 3"),
    # -o over results: refused, nothing lost
    ([*GEMM, "-o", "{results}"], "holds results already"),
    # a file that holds no results is never replaced, --overwrite or not, and the refusal says what it holds (issue 67)
    ([*GEMM, "-o", "{notes}", "--overwrite"], "-o {notes}: holds text, not results: it is never replaced"),
    ([*GEMM, "-o", "{notes}"], "-o {notes}: holds text, not results"),
    ([*GEMM, "-o", "{table}", "--overwrite"], "-o {table}: holds a wide_tessera dispatch table, not results"),
    ([*GEMM, "--save-dispatch", "{results}"], "{results}: holds results, not a wide_tessera dispatch table"),
    ([*GEMM, "--save-dispatch", "{notes}"], "{notes}: holds text, not a wide_tessera dispatch table"),
    (["tune", "gemm", "--preset", "ci", "--n-values", "1", "-o", "{notes}"], "{notes}: holds text, not a wide_tessera"),
    (["tune", "gemm", "--preset", "ci", "--n-values", "1", "--results", "{table}"], "--results {table}: holds a wide"),
    (["report", "{results}", "-o", "{user}"], "README.md: holds text, not a wide_tessera report"),
    # a table with an entry that cannot be trusted is not merged into, before anything is measured
    (["tune", "gemm", "--preset", "ci", "--n-values", "1", "-o", "{damaged}"], "entries[0] (gemm): N=4: speedup_ci"),
    # options that contradict each other (issue 67)
    ([*GEMM, "--overwrite"], "--overwrite replaces the results -o FILE holds: give -o FILE, or leave it out"),
    ([*GEMM, "-o", "{results}", "--overwrite", "--resume"], "--resume continues {results} and --overwrite replaces it"),
    ([*GEMM, "--search", "1:4"], "--search 1:4 chooses the N values itself: give --search or --n-values 1, not both"),
    (
        ["custom", "tests.helpers:Expert", "--input-shape", "2,16", "--kwarg", "d=16", "--n-values", "2",
         "--search", "1:4"],
        "give --search or --n-values 2, not both",
    ),
    ([*GEMM, "--controls-at", "every", "--no-controls"], "--controls-at 'every': this run times no controls"),
    # tracebacks that owed a line (issue 67)
    (
        ["custom", "tests.helpers:Expert", "--input-shape", "2,16", "--n-values", "2",
         "--kwarg", "d=" + "-" * 50000 + "1"],
        "--kwarg d=-------------------------------------...: nested too deeply to read as a Python literal",
    ),
    (["custom", "lazy:Thing", "--input-shape", "2,16", "--n-values", "2"], "'lazy:Thing': reading 'Thing' of it raised "
     "RuntimeError: boom"),
    (
        ["custom", "tests.helpers:Expert", "--input-shape", "99999999999999999999,16", "--n-values", "2"],
        "input_shape must be a non-empty tuple of positive ints up to 2147483647 (several inputs: a list of them), "
        "got (99999999999999999999, 16)",
    ),
    (["custom", "tests.helpers:Expert", "--input-shape", "0,16", "--n-values", "2"], "got (0, 16)"),
    # a factory of the user's that exits, or whose input changes shape: found before measuring (issue 67)
    (["custom", "tests.helpers:Expert", "--kwarg", "d=16", "--input-factory", "factories:quits", "--n-values", "2"],
     "input_factory() failed: SystemExit: 0"),
    (["custom", "factories:Quits", "--input-shape", "2,16", "--n-values", "2"], "SystemExit: 0"),
    (["custom", "tests.helpers:Expert", "--kwarg", "d=16", "--input-factory", "factories:grows", "--n-values", "2"],
     "input_factory() returned Tensor [2, 16] float32, then Tensor [3, 16] float32: give inputs of one shape"),
    # collectives: checked before any process group, outside torchrun too
    (["collectives", "--ops", "bogus"], "unknown collective 'bogus'"),
    (["collectives", "--min-bytes", "1GiB", "--max-bytes", "1KiB"], "--min-bytes 1GiB is larger than --max-bytes 1KiB"),
    (["collectives", "--dtype", "float64"], "unknown dtype 'float64'"),
]


@pytest.mark.parametrize("args,message", CLI_CASES, ids=[" ".join(a)[:60] for a, _ in CLI_CASES])
def test_the_cli_answers_hostile_input_with_one_line(args, message, places, monkeypatch):
    monkeypatch.chdir(places["tmp"])
    monkeypatch.syspath_prepend(places["tmp"])
    kept = [Path(places[name]) for name in ("results", "notes", "table")] + [Path(places["user"]) / "README.md"]
    before = [path.read_bytes() for path in kept]
    r = CliRunner().invoke(cli, [a.format(**places) for a in args])
    assert r.exit_code == 2, r.output
    assert message.format(**places) in r.output and "Traceback" not in r.output
    assert len([line for line in r.output.splitlines() if line.startswith("Error:")]) == 1
    assert [path.read_bytes() for path in kept] == before  # nothing lost


# a cache folder the OS refuses: refused before anything is measured
CACHE_CASES = [
    ("{blocker}", ["tune", "gemm", "--preset", "ci", "--n-values", "1", "--quiet"], "cannot make this dispatch table"),
    ("{blocker}", [*GEMM, "--no-save", "--roofline"], "{blocker}: cannot make this roofline cache folder"),
    ("/proc/nope", [*GEMM, "--no-save", "--roofline"], "/proc/nope: cannot make this roofline cache folder"),
]


@pytest.mark.parametrize("cache,args,message", CACHE_CASES, ids=[f"{c} {a[0]}" for c, a, _ in CACHE_CASES])
def test_a_cache_folder_that_cannot_be_made_is_one_line(cache, args, message, places, monkeypatch):
    monkeypatch.setenv("WIDE_TESSERA_CACHE_DIR", cache.format(**places))
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and message.format(**places) in r.output and "Traceback" not in r.output


def test_an_error_mid_run_is_one_line_and_the_points_measured_are_kept(tmp_path, monkeypatch):
    from wide_tessera.sweep import runner

    calls = []

    def cache_gone(device):  # the first op runs; the cache folder vanishes before the second
        calls.append(device)
        if len(calls) > 1:
            raise wt.WideTesseraError("/cache: cannot make this cache folder (No such file or directory)")

    monkeypatch.setattr(runner, "load_or_calibrate", cache_gone)
    out = tmp_path / "r.json"
    args = ["benchmark", "gemm", "conv1d", "--preset", "ci", "--device", "cpu", "--n-values", "1", "--budget", "0.005"]
    r = CliRunner().invoke(cli, [*args, "--quiet", "--roofline", "-o", str(out)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert [line for line in r.output.splitlines() if line.startswith("Error:")] == [
        "Error: /cache: cannot make this cache folder (No such file or directory)"
    ]
    assert [result.op for result in wt.load_results(out)] == ["gemm"]


def test_a_full_disk_says_which_file_and_that_the_earlier_one_is_intact(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    result = wt.load_results(Path(__file__).parent / "golden" / "schema6.json")
    import wide_tessera.core.files as files

    path = tmp_path / "kept.json"
    wt.save_results(result, path)
    before = path.read_text()
    real = files.tempfile.mkstemp

    def full_disk(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        os.dup2(os.open("/dev/full", os.O_WRONLY), fd)
        return fd, name

    files.tempfile.mkstemp = full_disk
    try:
        with pytest.raises(
            wt.WideTesseraError,
            match=r"kept.json: could not be written \(No space left on device\); the earlier file is intact",
        ):
            wt.save_results(result, path)
    finally:
        files.tempfile.mkstemp = real
    assert path.read_text() == before


def test_a_results_file_replaced_by_a_folder_mid_run_keeps_the_answer_printed(tmp_path, monkeypatch):
    from wide_tessera.results.schema import ResultsFile

    out = tmp_path / "r.json"
    real = ResultsFile.write
    calls = []

    def replaced(self, results):
        calls.append(self.path)
        if len(calls) == 2:  # after the first point, someone puts a folder where the file was
            Path(self.path).unlink()
            Path(self.path).mkdir()
        real(self, results)

    monkeypatch.setattr(ResultsFile, "write", replaced)
    args = ["benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--n-values", "1,2", "--budget", "0.005"]
    r = CliRunner().invoke(cli, [*args, "--quiet", "-o", str(out)])
    assert "is a directory" in r.stderr and r.stderr.count("is a directory") == 1
    assert "== gemm" in r.stdout and "Traceback" not in r.output  # the answer is printed
    assert r.exit_code == 4 and "the latest points are not in it" in r.stderr  # not kept: not a success


API_CASES = [
    ("load_results(None)", lambda: wt.load_results(None), "give the path of a results file"),
    ("DispatchTable.load(5)", lambda: DispatchTable.load(5), "give the path of a dispatch table"),
    ("entries_of('gemm')", lambda: entries_of("gemm"), "give one BenchmarkResult, got str"),
    ("to_dataframe('gemm.json')", lambda: wt.to_dataframe("gemm.json"), "give a list of BenchmarkResult"),
    ("merged([1, 2])", lambda: DispatchTable().merged([1, 2]), "give a list of DispatchEntry"),
    ("DispatchTable(None).save", lambda: DispatchTable(entries=None).save("t.json"), "give a list of DispatchEntry"),
    (
        "benchmark_custom(name=5)",
        lambda: wt.benchmark_custom(Expert, (2, 16), [2], name=5),
        "name=5: give the result's name",
    ),
    (
        "LoopedModules(tensor)",
        lambda: LoopedModules([nn.Linear(2, 2)] * 2)(torch.randn(2, 2)),
        "forward takes what pack gives",
    ),
    (
        "fuse(cuda_graph='yes')",
        lambda: wt.fuse([nn.Linear(2, 2)], cuda_graph="yes"),
        "cuda_graph='yes': give True or False",
    ),
    # the public wide modules say what is wrong, not torch from deep in forward
    (
        "WideLinear.pack(wrong width)",
        lambda: WideLinear(2, 4, 3).pack([torch.zeros(2, 5)] * 2),
        "pack: input 0 has shape [2, 5]; expected [..., 4]",
    ),
    (
        "WideFunctional.from_modules(unlike)",
        lambda: WideFunctional.from_modules([nn.Linear(4, 4), nn.Linear(4, 3)]),
        "from_modules: module 1's 'weight' is [3, 4] float32 on cpu but module 0's is [4, 4] float32 on cpu",
    ),
    (
        "WideSurgery(unlike)",
        lambda: WideSurgery([nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 3))]),
        "WideSurgery: module 1's '0.weight' is [3, 4] float32 on cpu but module 0's is [4, 4] float32 on cpu",
    ),
]


@pytest.mark.parametrize("name,call,message", API_CASES, ids=[c[0] for c in API_CASES])
def test_the_api_checks_its_arguments_at_the_door(name, call, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(wt.WideTesseraError, match=re.escape(message)) as info:
        call()
    assert "\n" not in str(info.value)


def test_files_with_impossible_numbers_do_not_load(tmp_path):
    doc = json.loads((Path(__file__).parent / "golden" / "schema6.json").read_text())
    doc["results"][0]["points"][0]["timings"]["baseline"] = 1e400  # JSON reads it as infinity
    (tmp_path / "inf.json").write_text(json.dumps(doc).replace("Infinity", "1e400"))
    with pytest.raises(wt.WideTesseraError, match="not a finite number"):
        wt.load_results(tmp_path / "inf.json")
    doc = json.loads((Path(__file__).parent / "golden" / "schema6.json").read_text())
    doc["results"][0]["points"][0]["n"] = 10**30
    (tmp_path / "huge.json").write_text(json.dumps(doc))
    with pytest.raises(wt.WideTesseraError, match="is more than 4096"):
        wt.load_results(tmp_path / "huge.json")


def test_a_model_whose_output_is_nan_is_not_called_random():
    class Nan(nn.Module):
        def forward(self, x):
            return x * float("nan")

    r = wt.benchmark_custom(Nan, (2, 3), [2], device="cpu", verbose=False)
    assert (
        "draws random numbers" not in str(r.points[0].failures)
        and r.points[0].failures["point"].error_type == "Unjudgeable"
    )


def test_a_multi_line_error_of_a_model_is_one_line():
    class Loud(nn.Module):
        def __init__(self):
            super().__init__()
            raise ValueError("first line\nsecond line")

    with pytest.raises(wt.WideTesseraError) as info:
        wt.benchmark_custom(Loud, (2, 3), [2])
    assert "\n" not in str(info.value) and "first line second line" in str(info.value)


class _Tiny(nn.Module):  # a class of the user's: fused by vmap or surgery
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


def _fused(strategy, n=4, tmp=None):
    torch.manual_seed(0)
    if strategy == "first call":
        return wt.fuse(
            [nn.Linear(4, 4) for _ in range(n)], table=tmp / "t.json", measure="first-call", time_bound_s=0.02
        )
    return wt.fuse(
        [_Tiny() if strategy in ("vmap", "surgery") else nn.Linear(4, 4) for _ in range(n)], strategy=strategy
    )


XS = [torch.randn(16, 4) for _ in range(4)]
# Calls of the wrong shape through what fuse() returns (issue 50, cause 1): one check where all pass.
CALL_CASES = [
    ("a stack of the inputs, not packed", lambda f, tmp: f(torch.stack(XS)),
     "call it with what its pack gives, fused\\(fused.pack\\(inputs\\)\\) of 4 inputs; got a Tensor of shape"),
    ("the unpacked list", lambda f, tmp: f(XS), "of 4 inputs; got a list"),
    ("a value packed for 2 models", lambda f, tmp: f(_fused("bmm", 2).pack(XS[:2])), "got a value packed for 2 models"),
    ("pack of 2 inputs", lambda f, tmp: f.pack(XS[:2]), "pack: give a list of 4 inputs, one per model; got 2"),
    ("pack of a tensor", lambda f, tmp: f.pack(torch.stack(XS)), "got a Tensor of shape \\[4, 16, 4\\]"),
    ("unpack of a foreign tensor", lambda f, tmp: f.unpack(torch.randn(7, 16, 4)),
     "holds 7 outputs, not 4|shape \\[7, 16, 4\\] does not hold 4 models|a tuple of 4 outputs"),
]  # fmt: skip


@pytest.mark.parametrize("strategy", ["loop", "bmm", "vmap", "surgery", "first call"])
@pytest.mark.parametrize("name,call,message", CALL_CASES, ids=[c[0] for c in CALL_CASES])
def test_a_call_of_the_wrong_shape_is_one_error_whatever_runs(name, call, message, strategy, tmp_path):
    fused = _fused(strategy, tmp=tmp_path)
    with pytest.raises(wt.WideTesseraError, match=message):
        call(fused, tmp_path)
    out = fused.unpack(fused(fused.pack(XS)))  # and the module still runs as the separate calls do
    assert all(torch.allclose(o, m(x), atol=1e-6) for o, m, x in zip(out, fused.unfuse(), XS))


@pytest.mark.parametrize("args", [["runs"], ["show", "@-1"]])
def test_a_runs_folder_that_is_a_file_is_named(args, places, monkeypatch):
    """It said 'no run kept in .../a-file yet' and exited 0."""
    monkeypatch.setenv("WIDE_TESSERA_RUNS", places["blocker"])
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and f"runs folder {places['blocker']} ($WIDE_TESSERA_RUNS" in r.output, r.output


@pytest.mark.parametrize(
    "args,advice",
    [
        ([*GEMM, "-o", "{tmp}/r2.json"], "continue it: the same command with --resume"),
        (GEMM, "continue it: the same command with --resume -o {tmp}/runs/"),  # the run kept: no -o was given
        (["tune", "gemm", "conv1d", "--preset", "ci", "--quiet", "-o", "{tmp}/t.json"], "wide_tessera tune gemm conv1"),
    ],
    ids=["benchmark -o", "benchmark", "tune"],
)
def test_the_advice_after_ctrl_c_is_a_command_that_runs(args, advice, places, monkeypatch):
    """tune said 'continue with --resume', which it lacks; benchmark without -o said so, then refused
    --resume without -o (issue 67)."""
    from wide_tessera.cli import run as commands

    monkeypatch.setenv("WIDE_TESSERA_RUNS", f"{places['tmp']}/runs")
    result = wt.load_results(Path(__file__).parent / "golden" / "schema6.json")[0]

    def interrupted(jobs, settings, previous, output, progress, finished):
        raise wt.core.errors.Interrupted(result, output)

    monkeypatch.setattr(commands, "measure_jobs", interrupted)
    r = CliRunner().invoke(cli, [a.format(**places) for a in args])
    assert r.exit_code == 130 and advice.format(**places) in r.output, r.output
    assert "continue with --resume" not in r.output


def _table_with(change):
    doc = json.loads(json.dumps(DispatchTable([entry(verdicts="loop:1 fuse:4")]).to_dict()))
    verdict = doc["entries"][0]["verdicts"][1]
    verdict.update(speedup=2.0, speedup_ci=[1.5, 2.5])
    change(doc["entries"][0], verdict)
    return doc


# A dispatch table's entries as a hand or a damaged disk leaves them: each refused where the table
# is read, naming the entry and the value (issue 67). (entry fields, its 'fuse' verdict at N=4)
TABLE_CASES = [
    ("speedup_ci of one", lambda e, v: v.update(speedup_ci=[3.0]), "N=4: speedup_ci [3.0]: give [low, high]"),
    ("speedup_ci of none", lambda e, v: v.update(speedup_ci=[]), "N=4: speedup_ci []: give [low, high]"),
    ("a negative speedup", lambda e, v: v.update(speedup=-2.0, speedup_ci=[3.0, -5.0]), "speedup -2.0: give"),
    ("an interval out of order", lambda e, v: v.update(speedup_ci=[3.0, 1.0]), "speedup_ci [3.0, 1.0]"),
    ("a speedup outside its interval", lambda e, v: v.update(speedup=9.0), "speedup 9.0 is outside its interval"),
    ("N = 10**30", lambda e, v: v.update(n=10**30), "verdicts must be for distinct N from 1 to 4096"),
    ("threads = -1", lambda e, v: e.update(threads=-1), "entries[0] (gemm): threads=-1: give an integer in [1, 4096]"),
    ("measured_at yesterday", lambda e, v: e.update(measured_at="yesterday"), "measured_at 'yesterday': give a time"),
    ("a switch of -1 s", lambda e, v: e.update(switch_s={"vmap": -1.0}), "switch_s['vmap']=-1.0: give a number"),
]


@pytest.mark.parametrize("name,change,message", TABLE_CASES, ids=[c[0] for c in TABLE_CASES])
def test_a_table_entry_that_cannot_be_trusted_is_refused_where_the_table_is_read(name, change, message, tmp_path):
    doc = _table_with(change)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(wt.WideTesseraError, match=re.escape(message)):
        DispatchTable.load(path)
    with pytest.raises(wt.WideTesseraError, match=re.escape(message)):  # an object given to fuse() is the same
        wt.fuse([nn.Linear(32, 32) for _ in range(4)], table=DispatchTable.from_dict(doc))
    with pytest.raises(wt.WideTesseraError, match=re.escape(message)):
        wt.fuse([nn.Linear(32, 32) for _ in range(4)], table=path)


def test_an_entry_naming_a_strategy_the_op_lacks_does_not_fuse():
    """The transformers integration looked the name up and raised KeyError (issue 67)."""
    from wide_tessera.dispatch.table import Case, decide

    table = DispatchTable([entry(verdicts="fuse:4", strategy="no_such_kernel")])
    params = {"batch": 16, "in_features": 32, "out_features": 32}
    case = Case(**{f: getattr(table.entries[0], f) for f in ("op", "device", "device_name", "dtype", "mode")},
                compile="none", cuda_graph=False, params=params, n=4)  # fmt: skip
    answer = decide(table, case, ["bmm", "einsum"], {}, "cpu")
    assert not answer.fuse and "gemm has no strategy 'no_such_kernel' (its strategies: bmm, einsum)" in answer.reason
    fused = wt.fuse([nn.Linear(32, 32) for _ in range(4)], table=table)
    assert not fused.decision.fused and "no strategy 'no_such_kernel'" in str(fused.decision)


class _CountsRows(nn.Module):  # returns an int beside its tensor
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), 3


class _Once(nn.Module):  # raises on its second call: N separate first calls succeed
    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("called twice")
        return self.lin(x)


def _nan_linear():
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight[0, 0] = float("nan")
    return lin


# Modules whose first call through fuse(measure='first-call') was not the separate calls' (issue 67):
# (what, one module, words the decision must hold, words it must not)
FIRST_CALL_CASES = [
    ("a forward returning an int", _CountsRows, "", "Boolean value of Tensor"),
    ("a module raising on its second call", _Once,
     "a repeated call of the separate modules raised RuntimeError: called twice", "no strategy"),
    ("NaN weights", _nan_linear, "unjudgeable: the separate call of model 0 gave NaN or Inf", "no strategy ran"),
]  # fmt: skip


@pytest.mark.parametrize("name,make,said,unsaid", FIRST_CALL_CASES, ids=[c[0] for c in FIRST_CALL_CASES])
def test_the_first_call_is_the_separate_calls(name, make, said, unsaid, tmp_path):
    torch.manual_seed(0)
    modules = [make() for _ in range(4)]
    separate = [make() for _ in range(4)]
    for mine, theirs in zip(separate, modules):
        mine.load_state_dict(theirs.state_dict())
    fused = wt.fuse(modules, table=tmp_path / "t.json", measure="first-call", time_bound_s=0.05)
    out = fused.unpack(fused(fused.pack(XS)))
    want = [m(x) for m, x in zip(separate, XS)]
    # within a fused result's rounding: which strategy the first call's timing picks varies with
    # the machine's load, and a batched matmul rounds a near-zero element otherwise than N small ones
    for got, expected in zip(out, want):
        for g, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, expected))):
            assert g == e if not isinstance(e, torch.Tensor) else torch.allclose(g, e, atol=1e-5, equal_nan=True)
    reason = str(fused.decision)
    assert said in reason and unsaid not in reason, reason


def test_measure_first_call_in_train_step_mode_is_one_line():
    """It was ignored without a word (issue 67)."""
    with pytest.raises(wt.WideTesseraError, match="measure='first-call' with mode='train_step': a first call"):
        wt.fuse([nn.Linear(4, 4) for _ in range(2)], measure="first-call", mode="train_step")


@pytest.mark.parametrize("out", [torch.tensor([3, 3]), torch.tensor([3.0, 3.0]), np.array([3, 3])], ids=str)
def test_a_plain_output_compared_with_a_tensor_is_wrong_not_an_error(out):
    """A wide module that gave a Tensor where the separate call gave an int made the check raise
    "Boolean value of Tensor with more than one value is ambiguous" (issue 67)."""
    from wide_tessera.core.correctness import check_outputs

    check = check_outputs([out], [3], 1e-5)
    assert not check.correct and "where the separate call gave 3" in check.error


def test_a_kept_run_continued_by_resume_is_not_its_own_previous_run(tmp_path, monkeypatch):
    """The advice after Ctrl-C without -o is --resume -o RUNFILE; the run so continued was then
    compared with itself, 'AGAINST THE PREVIOUS RUN (RUNFILE...)' (issue 67)."""
    monkeypatch.setenv("WIDE_TESSERA_RUNS", str(tmp_path / "runs"))
    run = ["benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--budget", "0.005", "--quiet"]
    assert CliRunner().invoke(cli, [*run, "--n-values", "1"]).exit_code == 0
    (kept,) = (tmp_path / "runs").glob("*.json")
    r = CliRunner().invoke(cli, [*run, "--n-values", "1,2", "--resume", "-o", str(kept)])
    assert r.exit_code == 0 and f"AGAINST THE PREVIOUS RUN ({kept.name}" not in r.output, r.output
