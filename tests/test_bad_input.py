"""Bad input, table-driven: every case is refused before anything is measured, with one line naming the value.

CLI: exit status 2, the message in the output, no traceback. API: WideTesseraError (a
ValueError) whose message names the value.
"""

import os
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from wide_tessera import (
    RunSettings,
    StageTimeouts,
    SweepParams,
    TimingConfig,
    WideOp,
    WideTesseraError,
    benchmark,
    benchmark_custom,
    load_results,
    measure,
    register,
    save_results,
)
from wide_tessera.cli import cli
from wide_tessera.ops import WideConv1d, WideLinear
from wide_tessera.ops.registry import REGISTRY
from wide_tessera.sweep.runner import run
from wide_tessera.widen.functional import WideFunctional

from .helpers import Expert

GEMM = ["benchmark", "gemm", "--preset", "ci"]
ATTN = ["benchmark", "flash_attention", "--preset", "ci"]
NAN, INF = float("nan"), float("inf")

# (arguments, text the one-line error must contain); {tmp}, {fifo}, {bad} are filled in per test.
CLI_CASES = [
    ([*GEMM, "--seed", "-1"], "--seed -1: give an integer in [0, 4294967295]"),
    ([*GEMM, "--seed", "4294967296"], "--seed 4294967296"),
    ([*GEMM, "--seed", "99999999999999999999"], "--seed 99999999999999999999"),
    ([*GEMM, "--seed", "1.5"], "'1.5' is not a valid integer"),
    ([*GEMM, "--seed", "abc"], "'abc' is not a valid integer"),
    ([*GEMM, "--budget", "nan"], "--budget nan: give a number of seconds in (0, 3600]"),
    ([*GEMM, "--budget", "inf"], "--budget inf"),
    ([*GEMM, "--budget", "-inf"], "--budget -inf"),
    ([*GEMM, "--budget", "0"], "--budget 0.0"),
    ([*GEMM, "--budget", "-1"], "--budget -1.0"),
    ([*GEMM, "--budget", "3601"], "--budget 3601.0"),
    ([*GEMM, "--budget", "1e9"], "--budget 1000000000.0"),
    ([*GEMM, "--budget", "fast"], "'fast' is not a valid float"),
    ([*GEMM, "--target-ci", "nan"], "--target-ci nan: give a fraction in (0, 1)"),
    ([*GEMM, "--target-ci", "inf"], "--target-ci inf"),
    ([*GEMM, "--target-ci", "0"], "--target-ci 0.0"),
    ([*GEMM, "--target-ci", "-0.5"], "--target-ci -0.5"),
    ([*GEMM, "--target-ci", "1"], "--target-ci 1.0"),
    ([*GEMM, "--target-ci", "50"], "--target-ci 50.0"),
    ([*GEMM, "--regret", "-0.1"], "--regret -0.1: give a fraction (0.02: 2%) in [0, 1]"),
    ([*GEMM, "--regret", "nan"], "--regret nan"),
    ([*GEMM, "--regret", "2"], "--regret 2.0"),
    ([*GEMM, "--regret", "2%"], "'2%' is not a valid float"),
    ([*GEMM, "--timeout-multiplier", "nan"], "--timeout-multiplier nan: give a number in (0, 1000]"),
    ([*GEMM, "--timeout-multiplier", "inf"], "--timeout-multiplier inf"),
    ([*GEMM, "--timeout-multiplier", "0"], "--timeout-multiplier 0.0"),
    ([*GEMM, "--timeout-multiplier", "-1"], "--timeout-multiplier -1.0"),
    ([*GEMM, "--timeout-multiplier", "1e6"], "--timeout-multiplier 1000000.0"),
    ([*GEMM, "--threads", "0"], "--threads 0: give an integer in [1, 4096]"),
    ([*GEMM, "--threads", "100000"], "--threads 100000"),
    ([*GEMM, "--threads", "two"], "'two': give a number of threads, or auto"),
    ([*GEMM, "--n-values", "5000"], "n_values: 5000 is more than 4096"),
    ([*GEMM, "--n-values", "99999999999"], "n_values: 99999999999 is more than 4096"),
    ([*GEMM, "--n-values", "1.5"], "n_values: '1.5' is not a positive integer"),
    ([*GEMM, "--n-values", "2,x"], "n_values: 'x' is not a positive integer"),
    ([*GEMM, "--n-values", "0"], "n_values: 0 is not a positive integer"),
    ([*GEMM, "--n-values", "-4"], "n_values: -4 is not a positive integer"),
    ([*GEMM, "--n-values", "4,4"], "n_values: [4, 4] repeats a value"),
    ([*GEMM, "--n-values", ""], "n_values: '' is not a positive integer"),
    ([*GEMM, "--set", "batch=16", "--set", "batch=32"], "--set batch is given twice"),
    ([*GEMM, "--set", "n_values=4"], "--set n_values=...: give N values with --n-values 4"),
    ([*GEMM, "--set", "batch=x"], "batch: 'x' is not a positive integer"),
    ([*GEMM, "--set", "batch=0"], "batch: 0 is not a positive integer"),
    ([*GEMM, "--set", "batch=-4"], "batch: -4 is not a positive integer"),
    ([*GEMM, "--set", "batch=1e3"], "batch: '1e3' is not a positive integer"),
    ([*GEMM, "--set", "in_features=nan"], "in_features: 'nan' is not a positive integer"),
    ([*GEMM, "--set", "dtype=fp8"], "unknown dtype 'fp8'"),
    ([*GEMM, "--set", "dtype=float32,float32"], "dtype: ['float32', 'float32'] repeats a value"),
    ([*GEMM, "--set", "scale=0.25"], "unknown sweep axis 'scale'"),
    ([*GEMM, "--set", "=4"], "--set '=4': expected AXIS=V1,V2"),
    ([*GEMM, "--set", "batch="], "--set 'batch=': expected AXIS=V1,V2"),
    ([*ATTN, "--set", "heads=3"], "d_model=64 is not divisible by heads=3"),
    ([*ATTN, "--set", "d_model=30"], "d_model=30 is not divisible by heads=4"),
    ([*ATTN, "--set", "heads=4,5"], "d_model=64 is not divisible by heads=5"),
    ([*ATTN, "--set", "causal=maybe"], "causal: 'maybe' is not True or False"),
    (["benchmark", "lora", "--preset", "ci", "--set", "split=skewed"], "split='skewed': give one of uniform, ragged"),
    (["benchmark", "conv1d", "--preset", "ci", "--set", "kernel_size=0"], "kernel_size: 0 is not a positive integer"),
    ([*GEMM, "--device", "cpu:1"], "unknown device 'cpu:1'"),
    ([*GEMM, "--device", "gpu"], "unknown device 'gpu'"),
    ([*GEMM, "--device", "cuda:-1"], "unknown device 'cuda:-1'"),
    ([*GEMM, "--device", ""], "unknown device ''"),
    ([*GEMM, "--device", "cpu", "--cuda-graph"], "--cuda-graph needs a CUDA device"),
    ([*GEMM, "--device", "cpu", "--energy"], "(--energy) cannot be measured: this run is on cpu"),
    ([*GEMM, "--memory-budget", "nan"], "--memory-budget 'nan'"),
    ([*GEMM, "--memory-budget", "-1GiB"], "--memory-budget '-1GiB'"),
    ([*GEMM, "-o", "/dev/full"], "-o /dev/full: is a character device, not a results file"),
    ([*GEMM, "-o", "{fifo}"], "{fifo}: is a FIFO, not a results file"),
    ([*GEMM, "-o", "{tmp}"], "{tmp}: is a directory, not a results file"),
    ([*GEMM, "-o", "/nonexistent/dir/r.json"], "folder '/nonexistent/dir' does not exist"),
    ([*GEMM, "--resume"], "--resume needs -o FILE"),
    ([*GEMM, "--resume", "-o", "{tmp}/missing.json"], "{tmp}/missing.json does not exist"),
    ([*GEMM, "--resume", "-o", "{bad}"], "{bad}: holds text, not results"),
    (["benchmark", "gemm", "--preset", "nope"], "unknown preset for gemm 'nope'"),
    (["benchmark", "gemm", "--preset", ""], "unknown preset for gemm ''"),
    (["benchmark", "gemm", "--all", "--preset", "ci"], "name one or more ops, or give --all"),
    (["benchmark", "--preset", "ci"], "name one or more ops, or give --all"),
    (["benchmark", "gemn", "--preset", "ci"], "unknown op 'gemn'; did you mean 'gemm'"),
    (["benchmark", "gemm", "linear", "conv9d", "--preset", "ci"], "unknown op 'conv9d'"),
    # axes that contradict each other or what the op can build: refused before measuring
    (["benchmark", "conv_transpose2d", "--preset", "ci", "--set", "kernel_size=1"], "kernel_size=1: this op's"),
    (["benchmark", "hf_experts", "--preset", "ci", "--set", "top_k=9"], "top_k=9 exceeds N=8 experts"),
    (["benchmark", "hf_experts", "--preset", "ci", "--n-values", "1"], "top_k=2 exceeds N=1 experts"),
    (
        ["benchmark", "hf_experts", "--preset", "ci", "--set", "model_type=qwen3_vl_moe_vision"],
        "model_type 'qwen3_vl_moe_vision': its experts cannot be built from its own config",
    ),
    (["show", "/dev/full"], "/dev/full: is a character device, not a results file"),
    (["show", "{fifo}"], "{fifo}: is a FIFO, not a results file"),
    (["show", "{tmp}"], "{tmp}: is a directory, not a results file"),
    (["show", "{tmp}/missing.json"], "{tmp}/missing.json: no such file, and no run in"),
    (["show", "{bad}"], "{bad}: not a wide_tessera results file"),
]


@pytest.fixture
def places(tmp_path):
    fifo, bad = tmp_path / "fifo", tmp_path / "bad.json"
    os.mkfifo(fifo)
    bad.write_text("hello")
    return {"tmp": str(tmp_path), "fifo": str(fifo), "bad": str(bad)}


@pytest.mark.parametrize("args,message", CLI_CASES, ids=[" ".join(a[1:]) for a, _ in CLI_CASES])
def test_bad_cli_input_exits_2_with_one_line(args, message, places):
    args = [a.format(**places) for a in args]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, r.output
    assert message.format(**places) in r.output
    assert "Traceback" not in r.output
    assert isinstance(r.exception, SystemExit)  # click's clean exit, not an escaped error
    error_lines = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1


def _op(**attrs):
    """A class deriving from WideLinear with some of its contract replaced."""
    return type("Broken", (WideLinear,), attrs)


class NoFactories(WideOp, nn.Module):
    BENCHMARK_STRATEGIES = ("fused",)
    BENCHMARK_SWEEPS = {"ci": SweepParams.of([1], batch=[2])}


def _linears(*dtypes):
    return [nn.Linear(4, 4).to(d) for d in dtypes]


# (id, call taking the test's namespace, text the WideTesseraError must contain)
API_CASES = [
    ("op as a list", lambda t: benchmark(["gemm"]), "op ['gemm']: give one op name as a string"),
    ("op None", lambda t: benchmark(None), "op None"),
    ("preset list", lambda t: benchmark("gemm", preset=["ci"]), "preset=['ci']: give a preset's name"),
    ("preset empty", lambda t: benchmark("gemm", preset=""), "unknown preset for gemm ''"),
    ("settings dict", lambda t: benchmark("gemm", settings={"seed": 3}), "settings={'seed': 3}: give a RunSettings"),
    ("settings and a keyword", lambda t: benchmark("gemm", settings=RunSettings.of(preset="ci"), seed=4),
     "seed=4 beside settings="),
    ("settings and a preset", lambda t: benchmark("gemm", "ci", settings=RunSettings.of(preset="ci")),
     "preset='ci' beside settings="),
    ("settings on a device absent", lambda t: benchmark("gemm", settings=RunSettings(device="cpu:1")),
     "unknown device 'cpu:1'"),
    ("settings of no device", lambda t: RunSettings(device="gpu"), "unknown device 'gpu'"),
    ("settings of no regret", lambda t: benchmark("gemm", settings=RunSettings(preset="ci", regret=None)),
     "regret=None: give a fraction"),
    ("custom preset beside settings",
     lambda t: benchmark_custom(Expert, (5, 16), [2], settings=RunSettings(), preset="custom"), "beside settings="),
    ("custom settings of a preset",
     lambda t: benchmark_custom(Expert, (5, 16), [2], settings=RunSettings.of(preset="ci")), "preset='ci': a custom"),
    ("seed float", lambda t: benchmark("gemm", preset="ci", seed=1.5), "seed=1.5: give an integer"),
    ("seed str", lambda t: benchmark("gemm", preset="ci", seed="a"), "seed='a'"),
    ("seed bool", lambda t: benchmark("gemm", preset="ci", seed=True), "seed=True"),
    ("seed negative", lambda t: benchmark("gemm", preset="ci", seed=-1), "seed=-1"),
    ("seed huge", lambda t: benchmark("gemm", preset="ci", seed=2**32), "seed=4294967296"),
    ("seed None", lambda t: benchmark("gemm", preset="ci", seed=None), "seed=None"),
    ("timing dict", lambda t: benchmark("gemm", preset="ci", timing={"budget_s": 1}), "timing={'budget_s': 1}"),
    ("timing float", lambda t: benchmark("gemm", preset="ci", timing=0.5), "timing=0.5: give a TimingConfig"),
    ("timeouts int", lambda t: benchmark("gemm", preset="ci", timeouts=5), "timeouts=5: give a StageTimeouts"),
    ("regret None", lambda t: benchmark("gemm", preset="ci", regret=None), "regret=None: give a fraction"),
    ("regret str", lambda t: benchmark("gemm", preset="ci", regret="2%"), "regret='2%'"),
    ("regret bool", lambda t: benchmark("gemm", preset="ci", regret=True), "regret=True"),
    ("regret above 1", lambda t: benchmark("gemm", preset="ci", regret=1.5), "regret=1.5: give a fraction"),
    ("memory budget 0", lambda t: benchmark("gemm", preset="ci", memory_budget=0), "memory_budget=0"),
    ("memory budget float", lambda t: benchmark("gemm", preset="ci", memory_budget=1.5), "memory_budget=1.5"),
    ("memory budget str", lambda t: benchmark("gemm", preset="ci", memory_budget="4GiB"), "memory_budget='4GiB'"),
    ("device cpu:1", lambda t: benchmark("gemm", preset="ci", device="cpu:1"), "unknown device 'cpu:1'"),
    ("device int", lambda t: benchmark("gemm", preset="ci", device=3), "unknown device 3"),
    ("n huge", lambda t: benchmark("gemm", preset="ci", n_values=[5000]), "n_values: 5000 is more than 4096"),
    ("n float", lambda t: benchmark("gemm", preset="ci", n_values=[1.5]), "n_values: 1.5 is not a positive"),
    ("n bool", lambda t: benchmark("gemm", preset="ci", n_values=[True]), "n_values: True is not a positive"),
    ("axis nested", lambda t: benchmark("gemm", preset="ci", batch=[[1]]), "batch: a list is not a single value"),
    ("axis None", lambda t: benchmark("gemm", preset="ci", batch=[None]), "batch: None is not a positive integer"),
    ("heads", lambda t: benchmark("flash_attention", preset="ci", heads=[3]), "d_model=64 is not divisible by heads=3"),
    ("custom seed", lambda t: benchmark_custom(Expert, (5, 16), [2], seed=-3), "seed=-3"),
    ("energy on cpu", lambda t: benchmark("gemm", preset="ci", device="cpu", energy=True), "energy=True (--energy)"),
    ("energy str", lambda t: benchmark_custom(Expert, (5, 16), [2], energy="yes"), "energy='yes': give True or False"),
    ("custom timing", lambda t: benchmark_custom(Expert, (5, 16), [2], timing="fast"), "timing='fast'"),
    ("custom n", lambda t: benchmark_custom(Expert, (5, 16), [4097]), "n_values: 4097 is more than 4096"),
    ("custom preset", lambda t: benchmark_custom(Expert, (5, 16), [2], preset="quick"), "preset='quick': a custom run"),
    ("budget nan", lambda t: TimingConfig(budget_s=NAN), "budget_s=nan: give a number of seconds in (0, 3600]"),
    ("budget inf", lambda t: TimingConfig(budget_s=INF), "budget_s=inf"),
    ("budget negative", lambda t: TimingConfig(budget_s=-1), "budget_s=-1"),
    ("budget str", lambda t: TimingConfig(budget_s="1"), "budget_s='1'"),
    ("budget huge", lambda t: TimingConfig(budget_s=1e6), "budget_s=1000000.0"),
    ("target 0", lambda t: TimingConfig(target_rel_ci=0), "target_rel_ci=0: give a fraction in (0, 1)"),
    ("target nan", lambda t: TimingConfig(target_rel_ci=NAN), "target_rel_ci=nan"),
    ("target 1", lambda t: TimingConfig(target_rel_ci=1.0), "target_rel_ci=1.0"),
    ("warmup negative", lambda t: TimingConfig(warmup_s=-0.1), "warmup_s=-0.1"),
    ("min samples 1", lambda t: TimingConfig(min_samples=1), "min_samples=1: give an integer in [2, 1000000]"),
    ("min samples float", lambda t: TimingConfig(min_samples=2.5), "min_samples=2.5"),
    ("max below min", lambda t: TimingConfig(min_samples=20, max_samples=10), "max_samples=10: give an integer in [20"),
    ("max samples inf", lambda t: TimingConfig(max_samples=INF), "max_samples=inf"),
    ("min sample s negative", lambda t: TimingConfig(min_sample_s=-0.001), "min_sample_s=-0.001"),
    ("cuda graph str", lambda t: TimingConfig(cuda_graph="yes"), "cuda_graph='yes': give True or False"),
    ("setup nan", lambda t: StageTimeouts(setup_s=NAN), "setup_s=nan: give a number of seconds"),
    ("check negative", lambda t: StageTimeouts(check_s=-1), "check_s=-1"),
    ("measure str", lambda t: StageTimeouts(measure_s="60"), "measure_s='60'"),
    ("warmup inf", lambda t: StageTimeouts(warmup_s=INF), "warmup_s=inf"),
    ("multiplier 0", lambda t: StageTimeouts(multiplier=0), "multiplier=0: give a number in (0, 1000]"),
    ("multiplier inf", lambda t: StageTimeouts(multiplier=INF), "multiplier=inf"),
    ("register int", lambda t: register("t_bad")(int), "<class 'int'> is not a WideOp subclass"),
    ("register function", lambda t: register("t_bad")(len), "is not a WideOp subclass"),
    ("register no factories", lambda t: register("t_bad")(NoFactories), "does not implement bench_model"),
    ("register no sweeps", lambda t: register("t_bad")(_op(BENCHMARK_SWEEPS={})), "needs BENCHMARK_SWEEPS"),
    ("register bad sweep", lambda t: register("t_bad")(_op(BENCHMARK_SWEEPS={"x": [1, 2]})), "preset 'x'"),
    ("register bad n", lambda t: register("t_bad")(_op(BENCHMARK_SWEEPS={"x": SweepParams.of([0])})), "0 is not"),
    ("register baseline", lambda t: register("t_bad")(_op(BENCHMARK_STRATEGIES=("baseline",))), "reserved"),
    ("register twice", lambda t: register("t_bad")(_op(BENCHMARK_STRATEGIES=("a", "a"))), "('a', 'a')"),
    ("register no strategies", lambda t: register("t_bad")(_op(BENCHMARK_STRATEGIES=())), "BENCHMARK_STRATEGIES"),
    ("register empty name", lambda t: register("")(WideLinear), "op name ''"),
    ("register taken", lambda t: register("gemm")(_op()), "op name 'gemm' is already registered"),
    ("save to dir", lambda t: save_results([t.result], t.tmp), "is a directory, not a results file"),
    ("save missing folder", lambda t: save_results([t.result], t.tmp / "no" / "r.json"), "does not exist"),
    ("save to fifo", lambda t: save_results([t.result], t.fifo), "is a FIFO, not a results file"),
    ("save to device", lambda t: save_results([t.result], "/dev/full"), "/dev/full: is a character device"),
    ("save one result", lambda t: save_results(t.result, t.tmp / "r.json"), "got BenchmarkResult"),
    ("save strings", lambda t: save_results(["x"], t.tmp / "r.json"), "give a list of BenchmarkResult"),
    ("save dicts", lambda t: save_results([{}], t.tmp / "r.json"), "give a list of BenchmarkResult"),
    ("load fifo", lambda t: load_results(t.fifo), "is a FIFO, not a results file"),
    ("load dir", lambda t: load_results(t.tmp), "is a directory, not a results file"),
    ("modules generator", lambda t: WideLinear.from_modules(m for m in _linears(torch.float32)), "got a generator"),
    ("modules empty", lambda t: WideLinear.from_modules([]), "at least one module"),
    (
        "modules dtypes",
        lambda t: WideLinear.from_modules(_linears(torch.float32, torch.float16)),
        "float16 on cpu but module 0's is [4, 4] float32",
    ),
    ("modules kinds", lambda t: WideLinear.from_modules([nn.Linear(4, 4), nn.ReLU()]), "module 1 is a ReLU"),
    (
        "functional dtypes",
        lambda t: WideFunctional.from_modules(_linears(torch.float32, torch.half)),
        "float16 on cpu but module 0's is [4, 4] float32",
    ),
    ("functional generator", lambda t: WideFunctional.from_modules(iter(_linears(torch.float32))), "got a list_it"),
    ("functional classes", lambda t: WideFunctional.from_modules([nn.Linear(4, 4), nn.ReLU()]), "cls='ReLU'"),
    ("pack count", lambda t: t.wide.pack([torch.zeros(3, 4)]), "pack: 1 inputs for 2 models"),
    ("pack shapes", lambda t: t.wide.pack([torch.zeros(3, 4), torch.zeros(2, 4)]), "input 1 is (2, 4)"),
    ("pack dtype", lambda t: t.wide.pack([torch.zeros(3, 4), torch.zeros(3, 4).half()]), "torch.float16"),
    ("pack non tensor", lambda t: t.wide.pack([torch.zeros(3, 4), [0.0] * 4]), "input 1 is a list"),
    ("pack a tensor", lambda t: t.wide.pack(torch.zeros(2, 3, 4)), "got a Tensor"),
    ("conv pack channels", lambda t: t.conv.pack([torch.zeros(1, 3, 8)] * 2), "expected [batch, 4, ...]"),
    ("measure gpu", lambda t: measure(lambda: None, device="gpu"), "unknown device 'gpu'"),
    ("measure not callable", lambda t: measure(5), "fn=5 is not callable"),
    ("measure config dict", lambda t: measure(lambda: None, config={}), "config={}: give a TimingConfig"),
]


@pytest.fixture(scope="module")
def a_result(saved_results):
    return load_results(saved_results)[0]


@pytest.mark.parametrize("call,message", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_bad_api_input_raises_one_line_naming_the_value(call, message, a_result, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t = SimpleNamespace(
        result=a_result,
        tmp=tmp_path,
        fifo=fifo,
        wide=WideLinear.from_modules(_linears(torch.float32, torch.float32)),
        conv=WideConv1d.from_modules([nn.Conv1d(4, 4, 3), nn.Conv1d(4, 4, 3)]),
    )
    with pytest.raises(WideTesseraError) as info:
        call(t)
    assert isinstance(info.value, ValueError)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_tables_are_large():
    assert len(CLI_CASES) + len(API_CASES) >= 80 and len(CLI_CASES) >= 60 and len(API_CASES) >= 60


def test_a_float_axis_is_set_from_the_command_line_as_a_float():
    """--set scale=0.25 on a user op with a float axis reaches the op as the float 0.25."""
    seen = []

    class Scaled(WideLinear):
        BENCHMARK_SWEEPS = {"t": SweepParams.of([1], batch=[2], in_features=[4], out_features=[4], scale=[1.0])}

        @classmethod
        def bench_inputs(cls, n, batch, in_features, scale, **_):
            seen.append(scale)
            return [scale * torch.randn(batch, in_features) for _ in range(n)]

    register("test_scaled")(Scaled)
    try:
        r = CliRunner().invoke(
            cli, ["benchmark", "test_scaled", "--preset", "t", "--quiet", "--budget", "0.001", "--set", "scale=0.25"]
        )
    finally:
        del REGISTRY["test_scaled"]
    assert r.exit_code == 0, r.output
    assert seen and all(s == 0.25 and isinstance(s, float) for s in seen)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: benchmark("gemm", preset="ci", confirm="sometimes"),
            "unknown confirm 'sometimes'.*valid: deciding, all, none",
        ),
        (lambda: run(WideLinear.benchmark_job("ci"), seed=-1, verbose=False), "seed=-1"),
        (lambda: run(WideLinear.benchmark_job("ci"), isolate="yes", verbose=False), "isolate='yes'"),
    ],
)
def test_run_settings_are_checked_before_anything_is_measured(call, match):
    with pytest.raises(WideTesseraError, match=match):
        call()


def test_an_error_says_what_kind_of_problem_it_is(tmp_path):
    """One hierarchy (core.errors): a caller tells bad input from a damaged file and a broken op class
    by type, and a fault while measuring is never mistaken for bad input."""
    from wide_tessera.core.errors import ContractError, DamagedFile, MeasurementFault, NotApplicable
    from wide_tessera.dispatch.table import DispatchTable
    from wide_tessera.measurement.energy import EnergyUnavailable
    from wide_tessera.measurement.stages import StageTimeout
    from wide_tessera.measurement.timing import TimedFunctionError

    damaged = tmp_path / "damaged.json"
    damaged.write_text('{"schema_version": 2, "resul')
    with pytest.raises(DamagedFile):
        load_results(damaged)
    with pytest.raises(DamagedFile):
        DispatchTable.load(damaged)
    with pytest.raises(ContractError, match="does not implement bench_model"):
        register("t_bad")(NoFactories)
    with pytest.raises(WideTesseraError) as bad_value:
        TimingConfig(min_samples=1)
    assert type(bad_value.value) is WideTesseraError
    assert issubclass(NotApplicable, ContractError)
    for fault in (StageTimeout, EnergyUnavailable, TimedFunctionError):
        assert issubclass(fault, MeasurementFault) and not issubclass(fault, WideTesseraError)
