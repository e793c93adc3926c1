"""The command line end to end, through click's test runner."""

import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from wide_tessera import load_results, register
from wide_tessera.cli import cli, parse_override
from wide_tessera.core.errors import WideTesseraError
from wide_tessera.ops.registry import REGISTRY

from .helpers import SometimesWrongLinear


def invoke(*args):
    """Run the CLI; benchmark runs sample briefly, through the real flags."""
    if args[0] == "benchmark":
        args = (*args, "--budget", "0.005", "--target-ci", "0.5")
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_list_shows_every_op_with_strategies_presets_and_axes():
    r = invoke("list")
    assert r.exit_code == 0
    for op in ("gemm (alias: linear)", "conv1d", "conv2d", "flash_attention"):
        assert op in r.output
    assert "strategies: baseline, grouped, channels_last, vmap" in r.output
    assert "kernel_size=" in r.output and "quick" in r.output
    # a probe that builds the op is left to the run, and list says so rather than nothing
    assert "deepgemm, batched_mm, sonicmoe: whether each runs here, the run asks at each point" in r.output


@pytest.mark.slow
def test_benchmark_writes_a_loadable_file_with_every_result(tmp_path):
    out = tmp_path / "results.json"
    r = invoke(
        "benchmark", "conv1d", "conv2d", "--preset", "ci", "--device", "cpu", "--n-values", "1,2", "-o", str(out)
    )
    assert r.exit_code == 0, r.output
    assert "== conv1d (preset ci) on cpu" in r.stdout and "== conv2d" in r.stdout
    assert "crossover: " in r.stdout and "ANSWERS (" in r.stdout  # each op's answer, then the closing table
    assert "[conv1d] 1/2 N=1" in r.stderr  # progress on stderr
    results = load_results(out)
    assert [x.op for x in results] == ["conv1d", "conv2d"]
    assert [p.n for p in results[0].points] == [1, 2]
    show = invoke("show", str(out))
    assert show.exit_code == 0 and show.stdout.count("== conv") == 2


def test_set_and_quiet(tmp_path):
    r = invoke(
        "benchmark",
        "gemm",
        "--preset",
        "ci",
        "--device",
        "cpu",
        "--quiet",
        "--n-values",
        "2",
        "--set",
        "batch=3",
        "--set",
        "dtype=float32,bfloat16",
    )
    assert r.exit_code == 0, r.output
    # where the run is kept, no progress (a busy machine is named, quiet or not)
    said = [line for line in r.stderr.splitlines() if "other processes use" not in line]
    assert len(said) == 1 and said[0].startswith("wrote 1 result(s) to ")
    assert "bfloat16" in r.stdout and "batch=3" in r.stdout


@pytest.mark.slow
def test_all_runs_every_op(tmp_path):
    out = tmp_path / "all.json"
    # N=2: hf_experts routes each token to its top_k=2 experts, and one expert cannot take two
    r = invoke("benchmark", "--all", "--preset", "ci", "--device", "cpu", "--n-values", "2", "--quiet", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert [x.op for x in load_results(out)] == [
        "gemm", "conv1d", "conv2d", "conv3d", "conv_transpose2d", "flash_attention", "moe_experts", "hf_experts", "mlp",
        "layernorm", "batchnorm1d", "batchnorm2d", "instancenorm1d", "instancenorm2d", "groupnorm", "embedding", "gru",
        "lstm", "lora",
    ]


def test_incorrect_strategy_makes_the_exit_status_nonzero():
    register("test_cli_wrong")(SometimesWrongLinear)
    try:
        r = invoke("benchmark", "test_cli_wrong", "--preset", "test", "--device", "cpu", "--n-values", "2")
    finally:
        del REGISTRY["test_cli_wrong"]
    assert r.exit_code == 1
    assert "INCORRECT" in r.stdout
    assert "2 failure(s)" in r.stderr and "raises: error in check: RuntimeError: kernel exploded" in r.stderr


BAD = [
    (["benchmark", "gemm", "--preset", "ci", "--target-ci", "2"], "--target-ci 2.0: give a fraction in (0, 1)"),
    (["benchmark", "gemm", "--preset", "ci", "--budget", "0"], "--budget 0.0: give a number of seconds in (0, 3600]"),
    (["benchmark", "gemm", "--preset", "ci", "--threads", "0"], "--threads 0: give an integer in [1, 4096]"),
    (["benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--cuda-graph"], "--cuda-graph needs a CUDA device"),
    (["benchmark", "gemn", "--preset", "ci"], "unknown op 'gemn'; did you mean 'gemm'"),
    (["benchmark", "--preset", "ci"], "name one or more ops, or give --all"),
    (["benchmark", "gemm", "--all"], "name one or more ops, or give --all"),
    (["benchmark", "gemm", "--preset", "huge"], "unknown preset for gemm 'huge'"),
    (["benchmark", "gemm", "--preset", "ci", "--n-values", "4,x"], "n_values: 'x' is not a positive integer"),
    (["benchmark", "gemm", "--preset", "ci", "--n-values", "0"], "n_values: 0 is not a positive integer"),
    (["benchmark", "gemm", "--preset", "ci", "--set", "chanels=4"], "unknown sweep axis 'chanels'"),
    (["benchmark", "gemm", "--preset", "ci", "--set", "batch"], "--set 'batch': expected AXIS=V1,V2"),
    (["benchmark", "gemm", "--preset", "ci", "--set", "dtype=fp8"], "unknown dtype 'fp8'"),
    (["benchmark", "gemm", "--preset", "ci", "--device", "npu"], "unknown device 'npu'"),
    (
        ["benchmark", "gemm", "--preset", "ci", "-o", "/nonexistent/dir/r.json"],
        "folder '/nonexistent/dir' does not exist",
    ),
    (["show", "/nonexistent.json"], "/nonexistent.json: no such file"),
    (["show", "/tmp"], "/tmp: is a directory, not a results file"),
    (["benchmark", "gemm", "--preset", "ci", "--resume"], "--resume needs -o FILE"),
    (
        ["benchmark", "gemm", "--preset", "ci", "--resume", "-o", "/tmp/wt-no-such-file.json"],
        "does not exist; run without --resume",
    ),
    (
        ["benchmark", "gemm", "--preset", "ci", "--memory-budget", "lots"],
        "--memory-budget 'lots': expected a size of at least one byte",
    ),
    (
        ["benchmark", "gemm", "--preset", "ci", "--memory-budget", "0MiB"],
        "--memory-budget '0MiB': expected a size of at least one byte",
    ),
    (
        ["benchmark", "gemm", "--preset", "ci", "--memory-budget", "3PB"],
        "--memory-budget '3PB': expected a size of at least one byte",
    ),
    (
        ["benchmark", "gemm", "--preset", "ci", "--timeout-multiplier", "0"],
        "--timeout-multiplier 0.0: give a number in (0, 1000]",
    ),
    (
        ["benchmark", "gemm", "--preset", "ci", "--timeout-multiplier", "-2"],
        "--timeout-multiplier -2.0: give a number in (0, 1000]",
    ),
    (["benchmark", "gemm", "--preset", "ci", "--threads", "-3"], "--threads -3: give an integer in [1, 4096]"),
    (["benchmark", "gemm", "--preset", "ci", "--n-values", "4,4"], "n_values: [4, 4] repeats a value"),
    (["benchmark", "gemm", "--preset", "ci", "--n-values", ""], "n_values: '' is not a positive integer"),
    (["benchmark", "gemm", "--preset", "ci", "--n-values", "-8"], "n_values: -8 is not a positive integer"),
    (["benchmark", "gemm", "--preset", "ci", "--set", "batch=0"], "batch: 0 is not a positive integer"),
    (["benchmark", "gemm", "--preset", "ci", "--set", "batch=1.5"], "batch: '1.5' is not a positive integer"),
    (["benchmark", "gemm", "--preset", "ci", "--set", "batch=true"], "batch: 'true' is not a positive integer"),
    (["benchmark", "gemm", "--preset", "ci", "--set", "dtype="], "--set 'dtype=': expected AXIS=V1,V2"),
    (
        ["benchmark", "flash_attention", "--preset", "ci", "--set", "causal=maybe"],
        "causal: 'maybe' is not True or False",
    ),
    (["benchmark", "gemm", "conv9d", "--preset", "ci"], "unknown op 'conv9d'"),
    (["benchmark", "gemm", "--preset", "ci", "--target-ci", "0"], "--target-ci 0.0: give a fraction in (0, 1)"),
    (["benchmark", "gemm", "--preset", "ci", "--budget", "-1"], "--budget -1.0: give a number of seconds in (0, 3600]"),
    (["benchmark", "gemm", "--preset", "ci", "--device", "cuda:x"], "unknown device 'cuda:x'"),
]
if not torch.cuda.is_available():
    BAD.append((["benchmark", "gemm", "--preset", "ci", "--device", "cuda"], "CUDA is not available on this machine"))


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_exits_2_with_one_clear_line(args, message):
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output
    assert isinstance(r.exception, SystemExit)  # click's clean exit, not an escaped error


def test_the_bad_input_table_is_large():
    assert len(BAD) >= 25


def test_resume_refuses_a_file_measured_differently(tmp_path):
    out = tmp_path / "r.json"
    assert (
        invoke(
            "benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--n-values", "1", "--quiet", "-o", str(out)
        ).exit_code
        == 0
    )
    r = CliRunner().invoke(
        cli, ["benchmark", "gemm", "--preset", "quick", "--device", "cpu", "--resume", "-o", str(out)]
    )
    assert r.exit_code == 2 and "has gemm measured with preset ci; this run asks for preset quick" in r.output


def test_output_that_is_a_directory_is_refused(tmp_path):
    r = CliRunner().invoke(cli, ["benchmark", "gemm", "--preset", "ci", "-o", str(tmp_path)])
    assert r.exit_code == 2 and "is a directory" in r.output


def test_parse_override():
    assert parse_override("channels=32,64") == ("channels", ["32", "64"])
    assert parse_override("causal=true,False") == ("causal", ["true", "False"])
    assert parse_override(" dtype = float32 ") == ("dtype", [" float32 "])  # the axis's kind reads (and strips) it
    with pytest.raises(WideTesseraError, match="expected AXIS=V1,V2"):
        parse_override("=3")


# The optional libraries an op or integration imports where it runs: `list` runs none of them
# (transformers' experts made it 26 s where torch alone took 6 s, 2-core CPU, loaded), and it
# imports every module that `--help` and the other commands' start do.
OPTIONAL = ("transformers", "peft", "optuna", "pandas", "matplotlib")


def test_list_imports_no_optional_library():
    code = (
        "import sys; from click.testing import CliRunner; from wide_tessera.cli import cli; "
        "r = CliRunner().invoke(cli, ['list']); assert r.exit_code == 0, r.output; "
        f"print(*[m for m in {OPTIONAL!r} if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


@pytest.mark.slow
def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "wide_tessera", "list"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "flash_attention" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "wide_tessera", "benchmark", "gemm", "--preset", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "unknown preset" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line: click's usage lines said nothing more


@pytest.mark.parametrize("other,threads,said,cpus,used", [
    # torch's two threads on a machine too busy for them: one, timed by its CPU clock
    (1.9, None, "busy machine: other processes use 1.9 of 2 cores, too busy for torch's 2: measuring with 1 thread(s), "
                "timed by its CPU clock", 2, 1),
    # threads the user asked for are kept, and what would measure is said
    (1.9, "2", "busy machine: other processes use 1.9 of 2 cores, and this run's 2 threads need 2 free", 2, 2),
    (1.9, "auto", "--threads auto: other processes use 1.9 of 2 cores: measuring with 1 thread(s), timed by its CPU "
                  "clock", 2, 1),
    (1.0, "auto", "--threads auto: other processes use 1.0 of 2 cores: measuring with 1 thread(s), timed by its CPU "
                  "clock", 2, 1),
    (0.0, "auto", "--threads auto: other processes use 0.0 of 2 cores: measuring with 2 thread(s)", 2, 2),
    (0.0, None, None, 2, 2),
    (1.0, None, "busy machine: other processes use 1.0 of 2 cores, too busy for torch's 2: measuring with 1", 2, 1),
    # under taskset -c 0: one CPU to run on, and a loop on it
    (1.0, "auto", "--threads auto: other processes use 1.0 of 1 cores: measuring with 1 thread(s), timed", 1, 1),
])  # fmt: skip
def test_a_busy_machine_is_named_before_measuring_and_auto_takes_its_free_cores(monkeypatch, tmp_path, other,
                                                                                 threads, said, cpus, used):
    """A busy machine cost 15 minutes of DISTURBED points, the remedy printed at the end; the probe
    says it before the first point and between ops (here: gemm, then layernorm), once. The cores
    are those the run may use: under taskset -c 0 beside a loop there, one was said free. The
    caller's threads are its own again after the run."""
    from wide_tessera.cli import load_watch

    monkeypatch.setattr(load_watch, "probe_load", lambda since: other)
    monkeypatch.setattr("wide_tessera.measurement.health.os.sched_getaffinity", lambda pid: set(range(cpus)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    out = tmp_path / "r.json"
    try:
        extra = ["--threads", threads] if threads else []
        r = invoke("benchmark", "gemm", "layernorm", "--preset", "ci", "--n-values", "1", "--no-save", "-o", str(out),
                   *extra)  # fmt: skip
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert r.exit_code in (0, 3), r.output
    lines = [line for line in r.output.splitlines() if "other processes use" in line]
    assert len(lines) == (1 if said else 0) and all(line.startswith(said) for line in lines), r.output
    results = load_results(out)
    assert [x.environment.threads for x in results] == [used, used] and after == 2
    assert {x.timer for x in results} == {"cpu_thread_time" if used == 1 else "cpu_perf_counter"}


def test_a_resume_naming_no_threads_continues_with_the_files_on_a_machine_busier_than_it_was(monkeypatch, tmp_path):
    """Left to the load, a resume beside another process measured with 1 thread where the file had
    2, and was refused ("measured with threads 2; this run asks for threads 1"): it continues with
    the file's count now, and names the busy machine."""
    from wide_tessera.cli import load_watch

    monkeypatch.setattr("wide_tessera.measurement.health.os.sched_getaffinity", lambda pid: {0, 1})
    before = torch.get_num_threads()
    out = tmp_path / "r.json"
    args = ["benchmark", "gemm", "--preset", "ci", "--budget", "0.01", "--no-save", "-o", str(out)]
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(load_watch, "probe_load", lambda since: 0.0)
        first = invoke(*args, "--n-values", "1")
        monkeypatch.setattr(load_watch, "probe_load", lambda since: 1.9)
        again = invoke(*args, "--n-values", "1,2", "--resume")
    finally:
        torch.set_num_threads(before)
    assert first.exit_code in (0, 3) and again.exit_code in (0, 3), again.output
    assert "--resume: measuring with 2 thread(s)" in again.output and "2 threads need 2 free" in again.output
    [result] = load_results(out)
    assert result.environment.threads == 2 and sorted(p.n for p in result.points) == [1, 2]


def test_the_load_between_ops_is_read_over_the_op_just_ended_without_a_wait_of_its_own(monkeypatch):
    from wide_tessera.measurement import health

    slept = []
    monkeypatch.setattr(health.time, "sleep", slept.append)
    health.probe_load()  # before the first op: a probe of its own
    op = health.HealthMonitor("cpu")
    monkeypatch.setattr(op, "seconds", lambda: 4.0)  # an op that measured for 4 s
    health.probe_load(op)
    assert slept[0] == pytest.approx(0.2, abs=0.05) and slept[1] == 0.0


def test_threads_auto_keeps_the_threads_it_began_with_for_every_pass(monkeypatch, tmp_path):
    """Set again between ops, the threads changed between an op's first pass and its
    confirmation (which come after every op's first pass), and the file recorded the last."""
    from wide_tessera.cli import load_watch

    loads = iter([0.0] + [1.9] * 10)  # quiet as it starts, busy from the first op on
    monkeypatch.setattr(load_watch, "probe_load", lambda since: next(loads))
    monkeypatch.setattr("wide_tessera.measurement.health.os.sched_getaffinity", lambda pid: {0, 1})
    before = torch.get_num_threads()
    out = tmp_path / "r.json"
    try:
        r = invoke("benchmark", "gemm", "layernorm", "--preset", "ci", "--n-values", "1,2", "--no-save",
                   "--threads", "auto", "--confirm", "all", "-o", str(out))  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert r.exit_code in (0, 3), r.output
    assert [x.environment.threads for x in load_results(out)] == [2, 2]


def test_timing_settings_and_threads_are_recorded(tmp_path):
    out = tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:
        r = invoke(
            "benchmark",
            "gemm",
            "--preset",
            "ci",
            "--device",
            "cpu",
            "--n-values",
            "2",
            "--threads",
            "1",
            "--quiet",
            "-o",
            str(out),
        )
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output
    result = load_results(out)[0]
    assert result.environment.threads == 1
    assert (result.timing.budget_s, result.timing.target_rel_ci, result.timing.cuda_graph) == (0.005, 0.5, False)


@pytest.mark.parametrize(
    "options, budget, confirm",
    [((), 0.1, "none"), (("--budget", "0.05", "--confirm", "all"), 0.05, "all")],
)
def test_the_ci_preset_is_a_smoke_run_unless_told_otherwise(tmp_path, options, budget, confirm):
    out = tmp_path / "ci.json"
    args = [
        "benchmark",
        "layernorm",
        "--preset",
        "ci",
        "--n-values",
        "1,2",
        "--set",
        "batch=4",
        "-o",
        str(out),
        *options,
    ]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)  # not invoke(): it gives a --budget
    assert r.exit_code == 0, r.output
    (result,) = load_results(out)
    assert (result.timing.budget_s, result.confirm) == (budget, confirm)
    unconfirmed = "unconfirmed: --confirm none" in r.stdout
    assert unconfirmed == (confirm == "none")


def test_presets_other_than_ci_confirm_and_control_as_always_and_quick_controls_on_a_gpu():
    from wide_tessera.measurement.settings import PRESET_RUNS, RunSettings, preset_run

    assert preset_run("full") == preset_run(None) == preset_run("custom")
    assert (preset_run("full").budget_s, preset_run("full").confirm) == (0.5, "deciding")
    assert (preset_run("quick").budget_s, preset_run("quick").confirm) == (0.25, "deciding")
    # (the tests' own default leaves controls out: conftest)
    assert preset_run("full").controls == ("cpu", "cuda") and preset_run("quick").controls == ("cuda",)
    assert not PRESET_RUNS["ci"].controls
    assert RunSettings(preset="ci").confirm == "none" and RunSettings(preset="ci", confirm="all").confirm == "all"
    assert RunSettings(preset="full").confirm == "deciding"
