"""A user's own code: modules of several or integer inputs, tuple and dict outputs, random
modules, strategies added to built-in ops, ops from --import and from installed plugins,
the `custom` command, and the progress shown while a run measures."""

import copy
import fcntl
import logging
import os
import pickle
import pty
import random
import struct
import subprocess
import sys
import termios
import textwrap
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import fx, nn

from wide_tessera import WideTesseraError, benchmark, benchmark_custom, load_results, register_strategy
from wide_tessera.cli import cli
from wide_tessera.core.layout import model_state_dicts
from wide_tessera.ops import WideLinear
from wide_tessera.sweep.isolation import call_isolated
from wide_tessera.sweep.runner import run
from wide_tessera.widen.custom import custom_job
from wide_tessera.widen.functional import WideFunctional

REPO = Path(__file__).resolve().parent.parent
FAST_FLAGS = ["--budget", "0.005", "--target-ci", "0.5", "--no-controls", "--device", "cpu"]


@pytest.fixture(autouse=True)
def _imports_forgotten():
    """Modules a test imports through --import (named user_*) and the path it adds leave with it."""
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if name.startswith("user_"):
            del sys.modules[name]


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 6), nn.Linear(4, 6)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


class Tagger(nn.Module):
    """Token ids in, scores out: an integer input."""

    def __init__(self, vocab=50):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.embed(ids))


class PairOut(nn.Module):
    """A tuple out, like nn.GRU's (output, hidden)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y, y.sum(-1)


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return {"logits": self.fc(x), "pooled": {"mean": x.mean(0)}}


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(F.gelu(self.fc(x)))


@pytest.mark.parametrize(
    "model,kwargs",
    [
        (TwoInputs, dict(input_shape=[(3, 8), (3, 4)])),
        (Tagger, dict(input_shape=(2, 5), input_dtype="int64", int_high=50)),
        (PairOut, dict(input_shape=(3, 8))),
        (DictOut, dict(input_shape=(3, 8))),
        (TwoInputs, dict(input_shape=None, input_factory=lambda: (torch.randn(2, 8), torch.randn(2, 4)))),
    ],
)
def test_benchmark_custom_fuses_the_modules_people_have(model, kwargs, fast_timing):
    r = benchmark_custom(model, n_values=[1, 3], device="cpu", verbose=False, timing=fast_timing, **kwargs)
    assert r.op == model.__name__ and r.all_correct, r.summary()
    assert all(p.correct == {"vmap": True, "surgery": True} for p in r.points)


def make_layer(d=8):
    """A factory function, as most code builds models."""
    return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


def same_every_time():
    torch.manual_seed(0)  # a fixed seed inside: every model it builds is the same
    return nn.Linear(8, 8)


def test_a_factory_function_builds_the_models_and_an_instance_is_refused(fast_timing):
    r = benchmark_custom(make_layer, (3, 8), [2], device="cpu", verbose=False, timing=fast_timing)
    assert r.op == "Sequential" and r.points[0].correct == {"vmap": True, "surgery": True}, r.summary()
    with pytest.raises(WideTesseraError, match="got an instance of `Sequential`; pass the class, or a function"):
        benchmark_custom(make_layer(), (3, 8), [2], verbose=False)
    with pytest.raises(WideTesseraError, match=r"<lambda>\(\*\*\{\}\) returned Tensor, not an nn.Module"):
        benchmark_custom(lambda: torch.zeros(2), (3, 8), [2], verbose=False)


def test_identical_models_from_a_seeded_factory_are_a_warning_isolated_or_not():
    isolated = partial(call_isolated, limit_s=60, what="trying same_every_time")
    for run_check in (lambda check: check(), isolated):
        with pytest.warns(UserWarning, match="every Linear built is the same .* fixed seed inside"):
            custom_job(same_every_time, (3, 8), [2], None, "float32", {}, run_check)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        custom_job(make_layer, (3, 8), [2], None, "float32", {})


def test_a_transformers_layer_from_its_config_on_the_command_line():
    pytest.importorskip("transformers")
    layer = "transformers.models.llama.modeling_llama:LlamaMLP"
    sizes = ["--config-kwarg", "hidden_size=16", "--config-kwarg", "intermediate_size=32"]
    args = ["custom", layer, "--config", "transformers:LlamaConfig", *sizes, "--config-kwarg", "num_attention_heads=2"]
    r = CliRunner().invoke(cli, [*args, "--input-shape", "3,16", "--n-values", "2", "--no-save", *FAST_FLAGS])
    assert r.exit_code == 0 and "== LlamaMLP (preset custom)" in r.stdout, r.output
    for bad, message in [
        ([layer, *sizes], "--config-kwarg is an argument of --config's class: give --config MODULE:CLASS too"),
        ([layer, "--config", "transformers:LlamaConfig", "--config-kwarg", "hidden_size=15"], "cannot build it from"),
        ([layer, "--config", "transformers:LlamaConfig", "--kwarg", "config=1"], "not both"),
    ]:
        r = CliRunner().invoke(cli, ["custom", *bad, "--input-shape", "3,16", "--n-values", "2"])
        assert r.exit_code == 2 and message in r.output, r.output


class IdsAndValues(Tagger):
    def forward(self, ids, x):
        return self.embed(ids).mean() + x


def test_integer_inputs_stay_integers_and_in_range():
    job = custom_job(IdsAndValues, [(2, 5), (3,)], [2], None, "float32", {}, input_dtype=["int64", "float"], int_high=7)
    ids, x = job.input_factory(2)[0]
    assert ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 7 and x.dtype == torch.float32


def test_a_wrong_leaf_of_a_tuple_output_is_caught(fast_timing):
    job = custom_job(PairOut, (3, 8), [2], None, "float32", {})

    class SecondLeafWrong(WideFunctional):
        def forward(self, *inputs):
            y, s = super().forward(*inputs)
            return y, s * 1.01

    job.wide_factory = SecondLeafWrong.from_modules
    job.strategies = ["vmap"]
    point = run(job, timing=fast_timing, verbose=False).points[0]
    assert point.correct == {"vmap": False} and "relative error" in point.checks["vmap"].error


def test_dropout_in_train_mode_is_checked_with_comparable_draws(fast_timing):
    r = benchmark_custom(
        Dropped, (4, 8), [1, 3], device="cpu", verbose=False, timing=fast_timing, randomness="different", train=True
    )
    assert r.all_correct and all(p.params["train"] is True and p.params["randomness"] == "different" for p in r.points)
    # The check can fail: a wide module that ignores the dropout masks is caught.
    job = custom_job(Dropped, (4, 8), [3], None, "float32", {}, randomness="different", train=True)
    job.seeded_check_factory = lambda modules, strategy: WideFunctional.from_modules(modules).eval()
    assert run(job, timing=fast_timing, verbose=False).points[0].correct == {"vmap": False, "surgery": False}


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_the_optimizer_controls_are_the_separate_calls_and_draw_what_they_draw(randomness, fast_timing):
    r = benchmark_custom(
        Dropped,
        (4, 8),
        [3],
        mode="train_step",
        randomness=randomness,
        controls=True,
        confirm="none",
        device="cpu",
        verbose=False,
        timing=fast_timing,
    )
    correct = r.points[0].correct
    assert correct["loop_foreach"] and correct["loop_fused"] and correct["vmap"], r.summary()


class Zeros(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * 0


class Ignores(Zeros):
    def forward(self, x):
        return x.tanh() + self.fc.weight.sum() * 0


@pytest.mark.parametrize(
    "model,why",
    [(Zeros, "every output is constant, whatever the parameters"), (Ignores, "the output does not depend on the")],
)
def test_a_check_that_cannot_tell_right_from_wrong_says_so_and_verifies_nothing(model, why, fast_timing):
    r = benchmark_custom(model, (4, 8), [2], device="cpu", verbose=False, timing=fast_timing)
    point = r.points[0]
    assert not any(point.correct.values()) and not r.all_correct
    assert f"cannot judge correctness: {why}" in point.failures["point"].message


def test_a_model_whose_input_is_empty_is_not_taken_for_one_that_ignores_its_parameters():
    from wide_tessera.core.correctness import vacuous_reference

    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    empty = torch.randn(0, 8)  # an expert that received no tokens
    reference = [first(torch.randn(3, 8)), second(empty)]
    assert vacuous_reference(reference, first(empty)) is None
    assert vacuous_reference([first(empty), second(empty)], first(empty)) is None


def test_a_random_module_refuses_compile_and_needs_a_randomness_mode():
    with pytest.raises(WideTesseraError, match="Dropped draws random numbers .*dropout in train mode"):
        benchmark_custom(Dropped, (4, 8), [2], verbose=False, train=True)
    with pytest.raises(WideTesseraError, match="compiled code draws its own way"):
        benchmark_custom(Dropped, (4, 8), [2], verbose=False, train=True, randomness="different", compile="default")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(input_shape=(2, 5), input_dtype="int64"), "input 0 is int64: give int_high"),
        (dict(input_shape=(2, 5), input_dtype="int8", int_high=5), "unknown input_dtype 'int8'"),
        (dict(input_shape=[(2, 5), (2, 0)]), r"each input_shape must be .* got \(2, 0\)"),
        (dict(input_shape=[(2, 5), (2,)], input_dtype=["int64"], int_high=5), "give one per input"),
        (dict(input_shape=(2, 5), input_factory=lambda: torch.zeros(2)), "not both"),
        (dict(input_shape=None, input_factory=lambda: [torch.zeros(2)]), "returned list; give a Tensor, a tuple"),
        (dict(input_shape=(2, 5), randomness="sometimes"), "unknown randomness 'sometimes'"),
        # a bound no input takes was dropped without a word (issue 67)
        (dict(input_shape=(2, 5), int_high=50), "int_high=50 .--int-high. bounds integer inputs, and no input is one"),
        (dict(input_shape=None, input_factory=lambda: torch.zeros(2), int_high=50), "or input_factory, not both"),
    ],
)
def test_bad_custom_inputs_are_one_clear_error(kwargs, message):
    with pytest.raises(WideTesseraError, match=message):
        benchmark_custom(Tagger, n_values=[2], verbose=False, **kwargs)


def _correct_kernel(wide):
    return lambda x: torch.baddbmm(wide.bias.unsqueeze(1), x, wide.weight.transpose(1, 2))


def _wrong_kernel(wide):
    return lambda x: torch.bmm(x, wide.weight.transpose(1, 2))  # forgets the bias


def test_an_outside_strategy_is_checked_timed_and_reported_like_the_ops_own(fast_timing):
    register_strategy("gemm", "mine", _correct_kernel)
    register_strategy("linear", "broken")(_wrong_kernel)  # the decorator form, through an alias
    r = benchmark("gemm", preset="ci", device="cpu", verbose=False, timing=fast_timing, n_values=[2])
    point = r.points[0]
    assert r.strategies[-2:] == ["mine", "broken"]
    assert point.correct["mine"] and "mine" in point.timings
    assert not point.correct["broken"] and "broken" not in point.timings
    assert "broken: incorrect" in r.summary()
    # It travels with the job, so an isolated worker (a fresh interpreter) builds it too.
    job = WideLinear.benchmark_job("ci", n_values=[2])
    assert pickle.loads(pickle.dumps(job)).strategies == job.strategies


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: register_strategy("gemm", "bmm", _correct_kernel), "already has a strategy 'bmm'"),
        (lambda: register_strategy("gemm", "loop_compiled", _correct_kernel), "already has a strategy"),
        (lambda: register_strategy("gemm", "my kernel", _correct_kernel), "an identifier"),
        (lambda: register_strategy("gemm", "k", 42), "is not callable"),
        (lambda: register_strategy("gemmm", "k", _correct_kernel), "did you mean 'gemm'"),
        (lambda: register_strategy("gemm", "k", _correct_kernel, needs="cuda"), "give a capabilities.Needs"),
    ],
)
def test_bad_outside_strategies_are_refused_where_registered(call, message):
    with pytest.raises(WideTesseraError, match=message):
        call()


def _write(directory: Path, name: str, text: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(text))


def test_import_adds_strategies_and_ops_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # found from the current directory, as `python -m` finds modules
    _write(
        tmp_path,
        "user_kernels",
        """
        import torch
        from wide_tessera import register_strategy

        @register_strategy("gemm", "user_right")
        def right(wide):
            return lambda x: torch.baddbmm(wide.bias.unsqueeze(1), x, wide.weight.transpose(1, 2))

        @register_strategy("gemm", "user_wrong")
        def wrong(wide):
            return lambda x: torch.bmm(x, wide.weight.transpose(1, 2))
        """,
    )
    runner = CliRunner()
    listed = runner.invoke(cli, ["list", "--import", "user_kernels"])
    assert "user_right (outside), user_wrong (outside)" in listed.output
    r = runner.invoke(
        cli, ["benchmark", "--import", "user_kernels", "gemm", "--preset", "ci", "--n-values", "2", *FAST_FLAGS]
    )
    assert r.exit_code == 1  # user_wrong is incorrect
    assert "user_wrong: incorrect" in r.stderr and "user_right" in r.stdout
    bad = runner.invoke(cli, ["benchmark", "--import", "user_nothing", "gemm", "--preset", "ci", *FAST_FLAGS])
    assert bad.exit_code == 2 and "cannot import 'user_nothing': ModuleNotFoundError" in bad.output


@pytest.mark.slow
def test_an_installed_plugin_offers_ops_through_its_entry_point(tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(site), str(REPO / "tests" / "plugin")],
        check=True,
        capture_output=True,
        cwd=tmp_path,  # pip builds in place: keep its build/ out of the repository
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    command = [sys.executable, "-m", "wide_tessera"]
    listed = subprocess.run([*command, "list"], env=env, capture_output=True, text=True, timeout=120)
    assert "demo_scale  [WideScale]" in listed.stdout and "demo_kernel (outside)" in listed.stdout, listed.stderr
    r = subprocess.run(
        [*command, "benchmark", "demo_scale", "--preset", "ci", *FAST_FLAGS], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and "== demo_scale (preset ci)" in r.stdout, r.stderr


def test_custom_command_end_to_end_with_output_resume_and_exit_codes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(
        tmp_path,
        "user_models",
        """
        from torch import nn

        class Expert(nn.Module):
            def __init__(self, d=8, hidden=16):
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

            def forward(self, x):
                return self.fc2(self.fc1(x).relu())

        class Recurrent(nn.GRU):
            pass
        """,
    )
    out = tmp_path / "custom.json"
    runner = CliRunner()
    args = ["custom", "user_models:Expert", "--input-shape", "4,12", "--kwarg", "d=12", "-o", str(out), *FAST_FLAGS]
    first = runner.invoke(cli, [*args, "--n-values", "1"])
    assert first.exit_code == 0, first.output
    assert "== Expert (preset custom)" in first.stdout
    resumed = runner.invoke(cli, [*args, "--n-values", "1,2", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    (result,) = load_results(out)
    assert [p.n for p in result.points] == [1, 2]
    assert "[Expert] 2/2 N=2" in resumed.stderr and "N=1" not in resumed.stderr  # N=1 was not measured again
    # vmap has no batching rule for aten::gru: a limitation of torch, skipped with its reason, not a failure
    gru = [
        "custom",
        "user_models:Recurrent",
        "--input-shape",
        "3,4",
        "--kwarg",
        "input_size=4",
        "--kwarg",
        "hidden_size=4",
    ]
    skipped = runner.invoke(cli, [*gru, "--n-values", "2", *FAST_FLAGS])
    why = "skipped: vmap: torch's vmap cannot run it: RuntimeError: Batching rule not implemented for aten::gru"
    assert skipped.exit_code == 0 and why in skipped.stdout, skipped.output
    for bad, message in [
        (["custom", "user_models:Expert", "--input-shape", "4,12"], "give the N values to try with --n-values"),
        (["custom", "user_models:Missing", "--input-shape", "4,8", "--n-values", "2"], "user_models has no 'Missing'"),
        (
            ["custom", "user_models:Expert", "--input-shape", "4,9", "--n-values", "2"],
            "input_shape (4, 9) does not fit",
        ),
        (
            ["custom", "user_models:Expert", "--input-shape", "4,8", "--n-values", "2", "--kwarg", "d"],
            "expected NAME=VALUE",
        ),
    ]:
        r = runner.invoke(cli, bad)
        assert r.exit_code == 2 and message in r.output, r.output


@pytest.mark.slow
def test_progress_is_a_bar_on_a_terminal_plain_lines_elsewhere_and_nothing_when_quiet():
    command = [sys.executable, "-m", "wide_tessera", "benchmark", "gemm", "--preset", "ci", "--n-values", "1,2"]
    command += [*FAST_FLAGS, "--confirm", "none"]
    env = dict(os.environ)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal 120 columns wide
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower, env=env, cwd=REPO)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=120) == 0
    os.close(leader)
    text = seen.decode(errors="replace")
    assert "gemm:" in text and "2/2" in text and ("point/s" in text or "s/point" in text), text
    assert "[gemm] 1/2 N=1" in text  # each point's line, above the bar

    plain = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert "[gemm] 1/2 N=1" in plain.stderr and "\r" not in plain.stderr and "point/s" not in plain.stderr
    quiet = subprocess.run([*command, "--quiet"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    # no point line, no bar (a busy machine's one line is a warning, and says so under --quiet too)
    assert quiet.returncode == 0 and "[gemm]" not in quiet.stderr and "point/s" not in quiet.stderr


@pytest.mark.slow
def test_a_custom_run_of_several_inputs_and_dropout_runs_isolated(fast_timing):
    # The job is pickled to a worker process: every factory in it must be an importable function.
    r = benchmark_custom(
        Dropped,
        (4, 8),
        [2],
        device="cpu",
        verbose=False,
        timing=fast_timing,
        isolate=True,
        randomness="different",
        train=True,
    )
    assert r.all_correct and r.points[0].correct == {"vmap": True, "surgery": True}
    r = benchmark_custom(
        TwoInputs, [(3, 8), (3, 4)], [2], device="cpu", verbose=False, timing=fast_timing, isolate=True
    )
    assert r.all_correct


# --- surgery: whole models, layer by layer -----------------------------------------------------


class Expert(nn.Module):
    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Mixed(nn.Module):
    """A grouped conv's layout, a layer no op fuses, a residual, a parameter read in forward,
    a reduction, a constant and a tuple out: every path of surgery."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv1d(4, 8, 3, padding=1), nn.LayerNorm(16), nn.Linear(8 * 16, 5)
        self.grouped = nn.Conv1d(8, 8, 1, groups=2)  # the conv op fuses groups=1 only: vmapped
        self.scale = nn.Parameter(torch.randn(5))

    def forward(self, x):
        y = F.relu(self.conv(x))
        y = self.norm(self.grouped(y)) + y[:, :, :16]
        return self.head(y.flatten(1)) * self.scale, y.mean(), torch.ones(2)


class Reshaping(nn.Module):
    """Sizes read from the input: they must be one model's sizes, not the stack's."""

    def __init__(self):
        super().__init__()
        self.fc, self.w = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        b = x.size(0)
        y = self.fc(x).reshape(b, 2, 4).flatten(1) + torch.zeros(x.shape) * x.dim()
        return y * self.w + x.size(-1) + x.ndim


class OnItsDevice(nn.Module):
    """A constant made where the input lives, in its dtype: x.device and x.dtype are each model's
    too, so the constant is made once (as a stacked value it was vmapped over no tensor and failed)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * torch.tensor([0.5], device=x.device, dtype=x.dtype)


class Branchy(nn.Module):
    """Control flow on the input's rank: vmap runs it (each model's rank is known), torch.fx cannot
    trace it, torch.export captures it (it runs forward on a fake tensor of known rank)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) if x.dim() == 2 else x


class OnValues(nn.Module):
    """Control flow on a tensor's values: neither torch.fx nor torch.export can capture one graph of it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -x


def test_surgery_swaps_the_layers_ops_fuse_and_matches_separate_calls():
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [Mixed() for _ in range(3)]
    wide = WideSurgery(models)
    assert wide.swapped == ["conv", "norm", "head"] and wide.looped == ["grouped"]
    xs = [torch.randn(2, 4, 16) for _ in range(3)]
    with torch.no_grad():
        for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
            want = model(x)
            assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    # a real module: backward reaches the stacked weights of the swapped layers
    loss = sum(t.sum() for t in wide(wide.pack(xs))[:2])
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in wide.parameters())


@pytest.mark.parametrize(
    "model,shape",
    [
        (Expert, (4, 16)),
        (Mixed, (2, 4, 16)),
        (Reshaping, (5, 8)),
        (OnItsDevice, (5, 8)),
        (TwoInputs, [(3, 8), (3, 4)]),
        (Tagger, (2, 5)),
    ],
)
def test_surgery_is_checked_like_every_strategy(model, shape, fast_timing):
    ids = dict(input_dtype="int64", int_high=50) if model is Tagger else {}
    r = benchmark_custom(model, shape, [1, 4], device="cpu", verbose=False, timing=fast_timing, **ids)
    assert r.strategies == ["vmap", "surgery"] and r.all_correct, r.summary()
    assert all(p.correct["surgery"] for p in r.points)


def test_surgery_returns_the_models_own_output_class():
    """A model returning transformers' BaseModelOutput: torch.fx kept its fields as a plain dict, and
    surgery was INCORRECT ('output 0 is a dict(...), expected a dict(...)': the message named no class)."""
    outputs = pytest.importorskip("transformers.modeling_outputs")
    from wide_tessera.widen.surgery import WideSurgery

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            return outputs.BaseModelOutput(last_hidden_state=y, hidden_states=(x, y.relu()))

    models = [Encoder() for _ in range(3)]
    xs = [torch.randn(2, 8) for _ in range(3)]
    wide = WideSurgery(models)
    assert wide.swapped == ["fc"]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        want = model(x)
        assert type(got) is outputs.BaseModelOutput and torch.allclose(got.last_hidden_state, want.last_hidden_state)
        assert all(torch.allclose(g, w) for g, w in zip(got.hidden_states, want.hidden_states))


class Rotary(nn.Module):
    """Called as transformers layers are: keyword inputs, a (cos, sin) pair, an optional mask left at
    None, and an output that holds a None."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        cos, sin = position_embeddings
        q = self.q(hidden_states) * cos + sin
        return {"out": self.o(F.scaled_dot_product_attention(q, q, q, attn_mask=attention_mask)), "cache": None}


ROPE = (torch.randn(4, 8), torch.randn(4, 8))  # tables every model gets: passed once


def rotary_inputs():
    return {"hidden_states": torch.randn(2, 4, 8), "position_embeddings": ROPE}


def test_the_wide_input_passes_shared_tensors_once_and_leaves_none_as_it_is():
    from wide_tessera.widen.surgery import WideSurgery

    models = [Rotary() for _ in range(3)]
    inputs = [(*rotary_inputs().values(), None) for _ in range(3)]
    for wide in (WideFunctional(models), WideSurgery(models)):
        packed = wide.pack(inputs)
        x, (cos, sin), mask = packed.args
        assert x.shape == (3, 2, 4, 8) and cos.shape == (3, 4, 8) and cos.stride(0) == 0 and mask is None
        for got, model, one in zip(wide.unpack(wide(packed)), models, inputs):
            assert got["cache"] is None and torch.allclose(got["out"], model(*one)["out"], atol=1e-6)
    with pytest.raises(WideTesseraError, match="pack: model 1's input is shaped"):
        wide.pack([inputs[0], inputs[1][:2]])


@pytest.mark.parametrize("mode", ["inference", "train_step"])
def test_keyword_inputs_shared_tables_and_optional_arguments(mode, fast_timing):
    r = benchmark_custom(
        Rotary, None, [3], input_factory=rotary_inputs, mode=mode, device="cpu", verbose=False, timing=fast_timing
    )
    assert r.points[0].correct == {"vmap": True, "surgery": True}, r.summary()


class Recurrent(nn.Module):
    """A GRU encoder with a BatchNorm head: vmap has no batching rule for aten::gru."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.gru, self.fc, self.bn = nn.GRU(d, d, batch_first=True), nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.bn(self.fc(out[:, -1]))


@pytest.mark.parametrize("mode", ["inference", "train_step"])
def test_surgery_fuses_a_recurrent_model_vmap_cannot_run(mode, fast_timing):
    r = benchmark_custom(
        Recurrent, (4, 5, 8), [1, 3], mode=mode, device="cpu", verbose=False, timing=fast_timing, confirm="none"
    )
    assert all(p.correct == {"surgery": True} for p in r.points), r.summary()
    assert all(p.failures["vmap"].kind == "skipped" and "aten::gru" in p.failures["vmap"].message for p in r.points)


def test_surgery_swaps_recurrent_layers_and_batch_norms():
    from wide_tessera.widen.surgery import WideSurgery

    assert WideSurgery([Recurrent(), Recurrent()]).swapped == ["gru", "fc", "bn"]


class CastingLinear(nn.Linear):
    """timm's Linear: an nn.Linear subclass defined outside torch.nn, whose own forward computes
    nn.Linear's (it casts only under TorchScript)."""

    def forward(self, input):
        if torch.jit.is_scripting():
            bias = self.bias.to(dtype=input.dtype) if self.bias is not None else None
            return F.linear(input, self.weight.to(dtype=input.dtype), bias=bias)
        return F.linear(input, self.weight, self.bias)


class WithCastingLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = CastingLinear(8, 8)

    def forward(self, x):
        return self.fc(x).relu()


def test_surgery_swaps_a_layer_by_what_it_is_not_its_exact_class():
    from wide_tessera.widen.surgery import WideSurgery

    models = [WithCastingLinear() for _ in range(3)]
    wide = WideSurgery(models)
    assert wide.swapped == ["fc"] and wide.looped == []
    xs = [torch.randn(4, 8) for _ in range(3)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        assert torch.allclose(got, model(x), atol=1e-6)


def test_a_wrong_swap_is_caught(fast_timing, monkeypatch):
    from wide_tessera.widen import surgery

    class OffByOne(WideLinear):
        def forward(self, x):
            return super().forward(x) + 1e-2

    monkeypatch.setattr(surgery, "fusing_ops", lambda: {nn.Linear: OffByOne})
    point = benchmark_custom(Expert, (4, 16), [2], device="cpu", verbose=False, timing=fast_timing).points[0]
    assert point.correct == {"vmap": True, "surgery": False} and "relative error" in point.checks["surgery"].error


def test_a_model_torch_fx_cannot_trace_is_captured_by_torch_export(caplog, monkeypatch):
    from wide_tessera.widen.surgery import WideSurgery

    # torch's loggers do not propagate to caplog's
    for name in ("torch._export.non_strict_utils", "torch.export.dynamic_shapes"):
        monkeypatch.setattr(logging.getLogger(name), "handlers", [caplog.handler])
    torch.manual_seed(0)
    models = [Branchy() for _ in range(3)]
    wide = WideSurgery(models)
    assert wide.captured is not None and wide.swapped == ["fc"]
    for shape in [(2, 8), (5, 8), (4, 8)]:  # one graph: its batch dimension is dynamic
        xs = [torch.randn(*shape) for _ in range(3)]
        for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
            torch.testing.assert_close(got, model(x))
    assert len(wide.captured._captures) == 1
    xs = [torch.randn(1, 8) for _ in range(3)]  # torch.export specialises a size of 1: captured again, and said
    with pytest.warns(UserWarning, match="captures Branchy again: x dimension 0 is 1, where the last capture took it"):
        torch.testing.assert_close(wide.unpack(wide(wide.pack(xs)))[2], models[2](xs[2]))
    assert len(wide.captured._captures) == 2
    assert "specialized" not in caplog.text  # torch.export's warning on a size of 1 declared dynamic
    assert "deprecated" not in caplog.text  # torch 2.13's warning on a size declared fixed as None
    xs = [torch.randn(2, 8, dtype=torch.float64) for _ in range(3)]
    wide.double()  # a new dtype: captured again, from the converted weights
    torch.testing.assert_close(wide.unpack(wide(wide.pack(xs)))[1], models[1].double()(xs[1]))


class NormedBranchy(nn.Module):
    """Branchy's control flow, and between its two layers an RMSNorm with a weight of lower rank
    than its input, a gated activation, and a bias given once for all models."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.weight = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x, bias):
        if x.dim() != 3:
            return x
        h = self.up(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.down(torch.nn.functional.silu(h) * h + bias.view(1, 16)) + x


def test_what_lies_between_swapped_layers_and_keeps_the_models_apart_runs_at_once_without_vmap(monkeypatch):
    """vmap cost about 70 us a call (2-core CPU), much of what kept surgery behind vmap of the
    whole model on small layers: elementwise stretches, reductions over the last dimensions and
    values of lower rank (a norm's weight, a bias shared by all models) run at once on the
    stacked values, and compute what each model computes, gradients too."""
    from wide_tessera.widen import rules
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [NormedBranchy() for _ in range(3)]
    wide = WideSurgery(models)
    bias = torch.randn(16)  # the same tensor for every model: passed once
    xs = [(torch.randn(2, 5, 8, requires_grad=True), bias) for _ in range(3)]
    vmapped = []
    real_vmap = rules.vmap
    monkeypatch.setattr(rules, "vmap", lambda *a, **k: vmapped.append(a) or real_vmap(*a, **k))
    out = wide.unpack(wide(wide.pack(xs)))
    assert wide.captured is not None and wide.swapped == ["up", "down"] and vmapped == []
    sum(o.square().sum() for o in out).backward()
    for got, model, (x, b) in zip(out, models, xs):
        alone = x.detach().requires_grad_()
        want = model(alone, b)
        want.square().sum().backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(x.grad, alone.grad)  # back through every stretch run at once
    # a bias of each model's own: its view gets the N axis in front of its shape, at once too
    xs = [(torch.randn(2, 5, 8), torch.randn(16)) for _ in range(3)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        torch.testing.assert_close(got, model(*x))
    assert vmapped == []


class Attending(nn.Module):
    """Branchy's control flow around a decoder's attention: heads split by a view, RoPE-like
    halves rotated with slices and cat, per-model or shared mask, SDPA or matmul-softmax, a
    split of one projection, dropout; and `sorted` ends it with an op no rule takes."""

    def __init__(self, sdpa, sort=False):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)
        self.sdpa, self.sort = sdpa, sort

    def forward(self, x, mask, cos):
        if x.dim() != 3:
            return x
        b, length, _ = x.shape
        q, k, v = (t.view(b, length, 2, 4).transpose(1, 2) for t in self.qkv(x).split(8, dim=-1))
        q = q * cos + torch.cat((-q[..., 2:], q[..., :2]), dim=-1) * cos.unsqueeze(0).flip(-1)
        if self.sdpa:
            h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1 if self.training else 0.0)
        else:
            weights = torch.softmax(q @ k.transpose(-2, -1) / 2.0 + mask, dim=-1)
            h = torch.matmul(F.dropout(weights, 0.1, self.training), v)
        h = h.transpose(1, 2).reshape(b, length, 8)
        return self.out(h.sort(dim=-1).values if self.sort else h)


@pytest.mark.parametrize("sdpa", [True, False])
@pytest.mark.parametrize("mask_of_each_model", [True, False])
def test_attention_between_swapped_layers_runs_at_once_with_its_heads_folded(monkeypatch, sdpa, mask_of_each_model):
    """A decoder's attention (views into heads, transposes, RoPE's slices and cat, softmax or
    SDPA) ran under vmap, a Llama layer's whole stretch of 40 ops; lowered op by op on the
    stacked values (widen/lowering.py), it runs at once and computes what each model does,
    with a mask of each model's own or one for all, gradients too."""
    from wide_tessera.widen import rules
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [Attending(sdpa).eval() for _ in range(3)]
    wide = WideSurgery(models)
    vmapped = []
    real_vmap = rules.vmap
    monkeypatch.setattr(rules, "vmap", lambda *a, **k: vmapped.append(a) or real_vmap(*a, **k))
    shared_mask, cos = torch.randn(2, 1, 5, 5), torch.rand(5, 4)
    masks = [torch.randn(1, 2, 5, 5) if mask_of_each_model else shared_mask for _ in range(3)]
    xs = [(torch.randn(2, 5, 8, requires_grad=True), m, cos) for m in masks]
    out = wide.unpack(wide(wide.pack(xs)))
    assert wide.swapped == ["qkv", "out"] and vmapped == []
    sum(o.square().sum() for o in out).backward()
    for got, model, (x, m, c) in zip(out, models, xs):
        alone = x.detach().requires_grad_()
        want = model(alone, m, c)
        want.square().sum().backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(x.grad, alone.grad)


def test_a_stretch_run_in_groups_of_models_computes_what_each_model_does(monkeypatch):
    """Where the stacked values outgrow the L2 cache, a stretch runs on groups of models (each
    group's part of every model's own input; shared ones whole), joined after: the same as the
    separate calls, gradients too, whatever the group size."""
    from wide_tessera.widen import rules
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [Attending(sdpa=True).eval() for _ in range(9)]
    wide = WideSurgery(models)
    cos = torch.rand(5, 4)
    xs = [(torch.randn(2, 5, 8, requires_grad=True), torch.randn(1, 2, 5, 5), cos) for _ in range(9)]
    monkeypatch.setattr(rules, "MANY_PASSES", 0)  # (a stretch that may run in groups is a Segment when captured)
    wide(wide.pack(xs))  # captured
    groups = []
    for capture in wide.captured._captures.values():
        for segment in (m for m in capture.graph.modules() if isinstance(m, rules.Segment) and m.once):
            graph = segment.once.graph
            segment.once = segment.once._replace(graph=lambda n, *a, graph=graph: groups.append(n) or graph(n, *a))
    # a model's largest value: its 2 x 5 x 24 projections, 960 bytes: alone, then in twos
    for l2, group in [(1, 1), (2 * 960, 2)]:
        monkeypatch.setattr(rules, "L2_BYTES", l2)
        groups.clear()
        out = wide.unpack(wide(wide.pack(xs)))
        assert group in groups and max(groups) < 9 and sum(groups) % 9 == 0
        for got, model, (x, m, c) in zip(out, models, xs):
            alone = x.detach().requires_grad_()
            want = model(alone, m, c)
            torch.testing.assert_close(got, want)
            (got_grad,) = torch.autograd.grad(got.square().sum(), x, retain_graph=True)
            torch.testing.assert_close(got_grad, torch.autograd.grad(want.square().sum(), alone)[0])


class ReadsItsRnn(nn.Module):
    """Branchy's control flow around an RNN whose output alone the model reads (or its state)."""

    def __init__(self, rnn, reads_state=False, times_input=False):
        super().__init__()
        self.rnn, self.fc, self.reads_state, self.times_input = rnn, nn.Linear(8, 8), reads_state, times_input

    def forward(self, x):
        if x.dim() != 3:
            return x
        out, state = self.rnn(x)
        h = torch.tanh(state[0] if self.reads_state else out)
        return self.fc(h * x if self.times_input else h)


@pytest.mark.parametrize("rnn", [nn.GRU, nn.LSTM])
def test_a_recurrent_layer_whose_output_the_model_reads_is_swapped_in_a_captured_graph(rnn):
    """torch.export's graph reads an nn.GRU's output as its op's first result; the wide GRU
    gives (output, state), which went on whole, and the next op failed on a tuple. It now
    takes the output; a model reading the state is refused in one line."""
    from wide_tessera.core.errors import NotApplicable
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [ReadsItsRnn(rnn(8, 8, batch_first=True)).eval() for _ in range(3)]
    wide = WideSurgery(models)
    xs = [torch.randn(2, 5, 8) for _ in range(3)]
    with warnings.catch_warnings():  # torch.export's note on the RNN's weight list is not the user's to act on
        warnings.simplefilter("error")
        out = wide.unpack(wide(wide.pack(xs)))
    for got, model, x in zip(out, models, xs):
        torch.testing.assert_close(got, model(x))
    assert wide.captured is not None and wide.swapped == ["rnn", "fc"]
    wide = WideSurgery([ReadsItsRnn(rnn(8, 8, batch_first=True), reads_state=True) for _ in range(3)])
    with pytest.raises(NotApplicable, match="the model reads .* of layer rnn, not its output alone"):
        wide(wide.pack(xs))


class TimesATable(nn.Module):
    """torch.fx traces it: a linear's output times a table the graph computes, of one more rank."""

    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(8, 8), nn.Parameter(torch.rand(8))

    def forward(self, x):
        h = self.fc(x)
        return h * torch.arange(3.0).view(3, 1, 1) + self.scale * h


def test_an_elementwise_call_on_a_shared_table_of_the_stacks_rank_keeps_each_models_shape():
    """torch.fx's elementwise rule took a table all models share, [3, 1, 1], as the stack's N axis:
    each of 3 models got [4, 8] where one gets [3, 4, 8], silently. It now aligns each model's
    dimensions (lowering.py's rule), and a model's own lower-rank weight too."""
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [TimesATable() for _ in range(3)]
    wide = WideSurgery(models)
    assert wide.captured is None  # torch.fx's graph
    xs = [torch.randn(4, 8) for _ in range(3)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        torch.testing.assert_close(got, model(x))


class PointwiseBetween(nn.Module):
    """Calls torch tags pointwise between two layers, none of them in a hand-written list, and a
    function of the user's that torch.fx keeps whole (torch.fx.wrap) under a name torch also has."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h = h - h.mean(-1, keepdim=True)
        h = torch.rsqrt(h.abs() + 1).clamp(0.2, 0.9) * torch.erf(h).sign() + torch.maximum(h, h.lerp(x, 0.5))
        return self.b(add(h, x))


@torch.fx.wrap
def add(x, y):  # mixes positions: taken as torch.add, it would mix the models' values too
    return x + y.flip(-1)


def test_a_function_of_a_package_named_like_torch_is_not_taken_by_its_name():
    """Only torch's and operator's functions are known by their names: a package whose name begins
    "torch" (torch_geometric, torchaudio) may have an `add` that mixes positions."""
    from wide_tessera.widen.rules import is_elementwise

    def mixing(x, y):
        return x + y.flip(-1)

    mixing.__name__, mixing.__module__ = "add", "torch_geometric.utils"
    graph = fx.Graph()
    x = graph.placeholder("x")
    for fn in (mixing, torch.add):
        node = graph.call_function(fn, (x, x))
        assert is_elementwise(node) == (fn is torch.add)


def test_surgery_runs_every_call_torch_tags_pointwise_at_once_and_a_users_function_under_vmap():
    """torch.fx's calls between layers ran at once only where a hand-written list named them
    (add, mul, relu, gelu, ...); rsqrt, clamp, erf, sign, maximum or lerp each went through vmap.
    The test is now torch's own pointwise tag in every form the call may take, as torch.export's
    stretches are lowered: only a reduction (a method, named as such) and the user's `add` run under
    vmap, and the models train as apart."""
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [PointwiseBetween() for _ in range(3)]
    wide = WideSurgery(models)
    assert wide.captured is None and wide.what_ran().endswith("calls under vmap: mean x1, add x1"), wide.what_ran()
    xs = [torch.randn(4, 8) for _ in range(3)]
    stacked = wide.pack(xs).requires_grad_()
    outs = wide.unpack(wide(stacked))
    sum(o.square().sum() for o in outs).backward()
    for got, grad, model, x in zip(outs, stacked.grad, models, xs):
        x = x.clone().requires_grad_()
        want = model(x)
        want.square().sum().backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(grad, x.grad)


@pytest.mark.parametrize("traced_by", ["fx", "export"])
def test_dropout_in_training_with_randomness_error_is_refused_in_one_line(traced_by):
    """vmap's refusal of a draw under randomness='error' came as torch's 80-line traceback from
    WideSurgery and fuse(); it now says what to give instead."""
    from wide_tessera.core.errors import WideTesseraError
    from wide_tessera.widen.surgery import WideSurgery

    between = lambda m, h, x, mem: F.dropout(h, 0.3, m.training)  # noqa: E731
    models = [Between(between) if traced_by == "export" else nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3))
              for _ in range(3)]  # fmt: skip
    wide = WideSurgery(models)
    xs = [(torch.randn(2, 5, 8), torch.randn(1, 5, 8)) if traced_by == "export" else torch.randn(2, 5, 8)] * 3
    with pytest.raises(WideTesseraError, match=r"draw random numbers .* give randomness='different'"):
        wide(wide.pack(xs))


class Between(nn.Module):
    """Two linears (swapped) and, between them, `what(self, h, x, memory)`; torch.fx cannot trace it."""

    def __init__(self, what, out=8):
        super().__init__()
        self.a, self.b, self.what = nn.Linear(8, 8), nn.Linear(out, 8), what
        self.register_buffer("t", torch.randn(8).half())
        self.w, self.bias = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))

    def forward(self, x, memory):
        if x.dim() != 3:
            return x
        return self.b(self.what(self, self.a(x), x, memory))


def _heads(t):
    return t.view(t.shape[0], 5, 2, 4).transpose(1, 2)


# Stretches the lowering got wrong or crashed on, each before its fix.
STRETCHES = {
    "permute keeps N in front": lambda m, h, x, mem: h.permute(0, 2, 1).relu().permute(0, 2, 1),
    "SDPA of keys over a batch of 1": lambda m, h, x, mem: F.scaled_dot_product_attention(
        _heads(h), _heads(mem), _heads(mem)).transpose(1, 2).reshape(2, 5, 8),
    "type_as keeps its input's rank": lambda m, h, x, mem: h + m.t.type_as(h).unsqueeze(0),
    "layer_norm of bf16 by fp32 weights": lambda m, h, x, mem: F.layer_norm(h.bfloat16(), (8,), m.w, m.bias).float(),
    "rms_norm of fp16 by fp16 weights": lambda m, h, x, mem: F.rms_norm(h.half(), (8,), m.w.half()).float(),
    "frexp gives two (vmap)": lambda m, h, x, mem: torch.mul(*torch.frexp(h)),
}  # fmt: skip


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("what", list(STRETCHES))
def test_a_stretch_lowered_computes_what_each_model_does(monkeypatch, what, grouped):
    from wide_tessera.widen import rules
    from wide_tessera.widen.surgery import WideSurgery

    if grouped:  # groups of one model
        monkeypatch.setattr(rules, "L2_BYTES", 1)
        monkeypatch.setattr(rules, "MANY_PASSES", 0)
    torch.manual_seed(0)
    models = [Between(STRETCHES[what]) for _ in range(3)]
    wide = WideSurgery(models)
    memory = torch.randn(1, 5, 8)  # one for all models
    xs = [(torch.randn(2, 5, 8), memory) for _ in range(3)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        want = model(*x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


def test_dropout_of_a_value_every_model_shares_draws_a_mask_for_each():
    """A stretch that reads only an input given once for all models ran once, and drew one
    dropout mask for all of them, even with randomness='different'."""
    from wide_tessera.widen.surgery import WideSurgery

    models = [Between(lambda m, h, x, mem: h + F.dropout(mem, 0.5, True).expand(2, 5, 8)) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    wide = WideSurgery(models, randomness="different")
    x, memory = torch.randn(2, 5, 8), torch.ones(1, 5, 8)
    out = wide.unpack(wide(wide.pack([(x, memory)] * 3)))
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])


def test_a_swapped_grus_output_in_a_stretch_run_in_groups(monkeypatch):
    """The wide GRU's (output, state) went whole to every group of models, and the groups'
    results were joined N x N."""
    from wide_tessera.widen import rules
    from wide_tessera.widen.surgery import WideSurgery

    monkeypatch.setattr(rules, "L2_BYTES", 1)
    monkeypatch.setattr(rules, "MANY_PASSES", 0)
    torch.manual_seed(0)
    # the stretch after the GRU reads the model's input too: it is grouped by that
    models = [ReadsItsRnn(nn.GRU(8, 8, batch_first=True), times_input=True).eval() for _ in range(3)]
    wide = WideSurgery(models)
    xs = [torch.randn(2, 5, 8) for _ in range(3)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        torch.testing.assert_close(got, model(x))


def test_a_stretch_with_an_op_no_rule_takes_runs_under_vmap_and_says_which(monkeypatch):
    from wide_tessera.widen import rules
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [Attending(sdpa=True, sort=True).eval() for _ in range(3)]
    wide = WideSurgery(models)
    cos = torch.rand(5, 4)
    xs = [(torch.randn(2, 5, 8), torch.randn(2, 1, 5, 5), cos) for _ in range(3)]
    vmapped = []
    real_vmap = rules.vmap
    monkeypatch.setattr(rules, "vmap", lambda *a, **k: vmapped.append(a) or real_vmap(*a, **k))
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        torch.testing.assert_close(got, model(*x))
    assert len(vmapped) == 1
    assert list(wide.captured.vmapped.values()) == ["sort.default has no rule"]


def test_dropout_in_a_stretch_run_at_once_draws_for_each_model_its_own_mask():
    """Training with randomness='different': each model's attention draws its own dropout mask,
    as N separate models would (and as vmap's 'different' does)."""
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [Attending(sdpa=False).train() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    wide = WideSurgery(models, randomness="different")
    x = (torch.randn(2, 5, 8), torch.zeros(2, 1, 5, 5), torch.ones(5, 4))
    out = wide.unpack(wide(wide.pack([x] * 3)))
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])  # the same model, its own draws
    with torch.no_grad():
        evaluated = wide.eval()(wide.pack([x] * 3))
    torch.testing.assert_close(wide.unpack(evaluated)[2], models[0].eval()(*x))


class WithATemperature(nn.Module):
    """A 0-dim buffer of a higher dtype than the activations, each model's own."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("t", torch.tensor(0.5, dtype=torch.float64))

    def forward(self, x):
        if x.dim() != 3:
            return x
        return self.b(self.a(x) * self.t)


def test_a_models_own_0_dim_tensor_promotes_no_dtype_in_a_stretch_run_at_once():
    """Stacked, a 0-dim float64 tensor has a dimension and raised float32 activations to float64:
    the next swapped layer refused the mixed dtypes, where each model computes in float32."""
    from wide_tessera.widen.surgery import WideSurgery

    models = [WithATemperature() for _ in range(3)]
    for i, m in enumerate(models):
        m.t.fill_(0.5 + i)
    wide = WideSurgery(models)
    xs = [torch.randn(2, 5, 8) for _ in range(3)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, model(x))


class SameLength(nn.Module):
    """Branches on its inputs' sizes: torch.fx cannot trace it, torch.export guards the branch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        if x.shape[1] == y.shape[1] and x.shape[1] % 2 == 0:
            return self.fc(x) + y
        return self.fc(x) * 2


@pytest.mark.parametrize("lengths", [(6, 3), (7, 7)])
def test_a_capture_with_dynamic_sizes_is_not_used_where_its_guards_fail(lengths):
    """A graph captured on equal even lengths was used for lengths 6 and 3, or 7 and 7, the other
    branch's inputs: max errors of 4.5 and 4.2, silently. Its guards now send such a call to a
    new capture, and say which guard failed."""
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [SameLength() for _ in range(3)]
    wide = WideSurgery(models)
    for length_x, length_y in [(6, 6), lengths]:
        xs = [(torch.randn(2, length_x, 8), torch.randn(2, length_y, 8)) for _ in range(3)]
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            out = wide.unpack(wide(wide.pack(xs)))
        for got, model, x in zip(out, models, xs):
            torch.testing.assert_close(got, model(*x))
    assert len(wide.captured._captures) == 2 and "Guard failed" in str(said[0].message)


def test_a_model_nothing_can_capture_is_skipped_by_surgery_with_both_reasons(fast_timing):
    r = benchmark_custom(OnValues, (2, 8), [2], device="cpu", verbose=False, timing=fast_timing)
    point = r.points[0]
    assert "surgery" not in point.correct and point.failures["surgery"].kind == "skipped"
    why = point.failures["surgery"].message
    assert why.startswith("surgery: neither torch.fx nor torch.export can capture OnValues: torch.fx: ")
    assert "; torch.export: " in why and "\n" not in why and len(why) < 600


def test_surgery_keeps_dropout_comparable(fast_timing):
    r = benchmark_custom(
        Dropped, (4, 8), [3], device="cpu", verbose=False, timing=fast_timing, randomness="different", train=True
    )
    assert r.points[0].correct == {"vmap": True, "surgery": True}


_ONE = nn.Linear(8, 8)


def one_instance():
    return _ONE


class Counting(nn.Module):
    """A forward that updates a buffer in place: stateful, not random."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_a_factory_returning_one_object_is_named_and_a_stateful_forward_is_not_called_random():
    with pytest.warns(UserWarning, match="the factory returned one Linear object for two builds"):
        custom_job(one_instance, (3, 8), [2], None, "float32", {})
    # it was refused as drawing random numbers, and told to give randomness=
    with pytest.raises(WideTesseraError, match="Counting's forward updates its own buffers \\(calls\\) and its output"):
        custom_job(Counting, (3, 8), [2], None, "float32", {})


class KeepsState(nn.Module):
    """A model computing from its own buffers alone and updating them in forward: a scale kept as
    its log, a running average, a step count, a bfloat16 table; `branches`: its forward branches on
    a size, which torch.fx cannot trace; `plus`: it counts by `+=`, which torch.fx traced as an
    assignment its graph does not keep (torch.export captures either)."""

    def __init__(self, branches: bool, plus: bool):
        super().__init__()
        self.lin, self.branches, self.plus = nn.Linear(4, 4), branches, plus
        self.register_buffer("log_scale", torch.randn(4))
        self.register_buffer("ema", torch.randn(4))
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("table", torch.randn(4).to(torch.bfloat16))

    def forward(self, x):
        y = self.lin(x) * self.log_scale.exp()
        self.ema.mul_(0.5).add_(0.5 * y.detach().mean(0))
        if self.plus:
            self.steps += 1
        else:
            self.steps.add_(1)
        y = (y + self.ema) * self.steps + self.table.float()
        return y if not self.branches or x.shape[-1] > 1 else -y


@pytest.mark.parametrize(
    "branches,plus", [(False, False), (False, True), (True, False)], ids=["torch.fx", "+=", "torch.export"]
)
def test_what_a_model_computes_of_its_buffers_alone_and_updates_in_them_is_each_models_own(branches, plus):
    """torch.fx ran what a model computes of a buffer alone at trace time, on the traced model's,
    and kept it as a constant for all N (models 1 and 2 off by 1.39 and 1.01), and left updates in
    place out of its graph."""
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [KeepsState(branches, plus) for _ in range(3)]
    wide = WideSurgery(copy.deepcopy(models))
    assert (wide.captured is not None) == (branches or plus)
    for _ in range(2):  # the second call reads what the first left in the buffers
        xs = [torch.randn(2, 4) for _ in range(3)]
        got = wide.unpack(wide(wide.pack(xs)))
        for g, model, x in zip(got, models, xs):
            want = model(x)
            torch.testing.assert_close(g, want)
            want.pow(2).sum().backward()
        sum(g.pow(2).sum() for g in got).backward()
    for state, model in zip(model_state_dicts(wide, 3), models):
        for name, buffer in model.named_buffers():
            torch.testing.assert_close(state[name], buffer)
    weight = next(p.grad for name, p in wide.named_parameters() if name.endswith("weight"))
    for i, model in enumerate(models):
        torch.testing.assert_close(weight[i], model.lin.weight.grad)


class SharesALayer(nn.Module):
    """A layer used by two blocks, and a buffer, registered under two names each; its forward
    branches on a size, which torch.fx cannot trace (torch.export captures it)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Sequential(self.l, nn.ReLU()) for _ in range(2)])
        self.register_buffer("b", torch.randn(4))
        self.sub = nn.Module()
        self.sub.register_buffer("b2", self.b)

    def forward(self, x):
        x = x * 2 if x.shape[0] > 1 else x
        for block in self.blocks:
            x = block(x)
        return x + self.sub.b2


def test_a_layer_and_a_buffer_registered_under_two_names_are_each_models_own_in_a_captured_graph():
    """torch.export's graph called the layer and read the buffer by their second names, which
    named_modules and named_buffers skip: neither swapped nor stacked, they were held as the
    captured model's, and every model ran with model 0's weights."""
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [SharesALayer() for _ in range(3)]
    wide = WideSurgery(copy.deepcopy(models))
    xs = [torch.randn(3, 4) for _ in range(3)]
    got = wide.unpack(wide(wide.pack(xs)))
    assert wide.captured is not None and wide.swapped == ["l"]
    for g, model, x in zip(got, models, xs):
        torch.testing.assert_close(g, model(x))
        model(x).pow(2).sum().backward()
    sum(g.pow(2).sum() for g in got).backward()
    grads = {name: p.grad for name, p in wide.named_parameters()}
    assert grads and all(g is not None for g in grads.values())
    weight = next(g for name, g in grads.items() if name.endswith("weight"))
    for i, model in enumerate(models):
        torch.testing.assert_close(weight[i], model.l.weight.grad)


class Running(nn.Module):
    """A running sum kept in a buffer, updated by `+=` or (`assigns`) by assigning the buffer."""

    def __init__(self, assigns=False):
        super().__init__()
        self.lin, self.assigns = nn.Linear(4, 4), assigns
        self.register_buffer("c", torch.randn(4))

    def forward(self, x):
        y = self.lin(x)
        if self.assigns:
            self.c = self.c + y.detach().mean(0)
        else:
            self.c += y.detach().mean(0)
        return y * self.c


def test_a_buffer_updated_by_plus_equals_and_multiplied_in_trains_as_each_model_does():
    """torch.export writes the buffer back with copy_ (c.add_, then c.copy_(c)), which bumped the
    version of what the product had saved: backward raised "modified by an inplace operation"
    where each model alone trains."""
    from wide_tessera.widen.surgery import WideSurgery

    torch.manual_seed(0)
    models = [Running() for _ in range(3)]
    wide = WideSurgery(copy.deepcopy(models))
    xs = [torch.randn(3, 4) for _ in range(3)]
    got = wide.unpack(wide(wide.pack(xs)))
    sum(g.pow(2).sum() for g in got).backward()
    weight = next(p.grad for name, p in wide.named_parameters() if name.endswith("weight"))
    for i, (model, x) in enumerate(zip(models, xs)):
        model(x).pow(2).sum().backward()
        torch.testing.assert_close(weight[i], model.lin.weight.grad)


def test_a_buffer_assigned_in_forward_is_kept_by_surgery_and_refused_by_vmap_in_one_line():
    """vmap's functional_call put each model's given buffer back after forward: the assignment was
    lost and outputs were 1.1 off from the second call, silently."""
    from wide_tessera import fuse
    from wide_tessera.core.errors import NotApplicable

    torch.manual_seed(0)
    models = [Running(assigns=True) for _ in range(3)]
    vmapped = fuse(copy.deepcopy(models), strategy="vmap")
    xs = [torch.randn(3, 4) for _ in range(3)]
    with pytest.raises(NotApplicable, match="vmap cannot keep forward's assignment to buffer c"):
        vmapped(vmapped.pack(xs))
    wide = fuse(copy.deepcopy(models), strategy="surgery")
    for _ in range(2):
        xs = [torch.randn(3, 4) for _ in range(3)]
        for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
            torch.testing.assert_close(got, model(x))


class Branching(nn.Module):
    """A layer; `branches`: a forward torch.fx cannot trace (a branch on a shape, `branched`)."""

    def __init__(self, branches=False):
        super().__init__()
        self.lin, self.branches = nn.Linear(4, 4), branches

    def branched(self, x):
        return x * 2 if self.branches and x.shape[0] > 1 else x


class DropsAtRandom(Branching):
    """Skips its layer with probability 1/2, drawn from Python's generator (a stochastic depth)."""

    def forward(self, x):
        x = self.branched(x)
        return self.lin(x) if random.random() < 0.5 else x


@pytest.mark.parametrize("strategy,branches", [("vmap", False), ("surgery", False), ("surgery", True)])
def test_models_that_draw_from_pythons_generator_are_refused_in_one_line(strategy, branches):
    """A captured graph kept the draw its capture made for every call, and vmap drew once for all N
    models, where N separate calls draw N times: silently another training."""
    from wide_tessera import fuse
    from wide_tessera.core.errors import NotApplicable

    models = [DropsAtRandom(branches) for _ in range(3)]
    wide = fuse(models, strategy=strategy)
    with pytest.raises(NotApplicable, match="draw from Python's or NumPy's random generator in forward"):
        wide(wide.pack([torch.randn(2, 4)] * 3))


class ModeBranch(Branching):
    """Doubles its output in training only, and drops its input in training (rate 0: no draw)."""

    def forward(self, x):
        h = self.lin(torch.nn.functional.dropout(self.branched(x), 0.0, self.training))
        return h * 2 if self.training else h


@pytest.mark.parametrize("branches", [False, True])
@pytest.mark.parametrize("built_in", ["train", "eval"])
def test_surgery_follows_train_and_eval_as_the_models_do(branches, built_in):
    """torch.fx read `self.training` once, as the Python value it is at the trace: after
    fused.eval() the graph ran the train branch for good (an error of 1.99)."""
    from wide_tessera import fuse

    models = [ModeBranch(branches).train(built_in == "train") for _ in range(3)]
    wide = fuse(copy.deepcopy(models), strategy="surgery")
    xs = [torch.randn(2, 4) for _ in range(3)]
    for training in (True, False, True):
        wide.train(training)
        for model in models:
            model.train(training)
        for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
            torch.testing.assert_close(got, model(x))


class Counted(Branching):
    """Halves its output from its third call, counted in a plain attribute (a warm-up kept in the module)."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(self.branched(x)) * (0.5 if self.calls > 2 else 1.0)


class Teacher(Branching):
    """A student (`lin`) beside a teacher it reads without gradients: the teacher's weights stay as they are."""

    def __init__(self, branches=False):
        super().__init__(branches)
        self.teacher = nn.Linear(4, 4)

    def forward(self, x):
        x = self.branched(x)
        with torch.no_grad():
            target = self.teacher(x)
        return self.lin(x) - target


class Phased(Branching):
    """Counts its calls in a dict (a warm-up by phase)."""

    def __init__(self, branches=False):
        super().__init__(branches)
        self.seen = {"calls": 0}

    def forward(self, x):
        self.seen["calls"] += 1
        return self.lin(self.branched(x)) * (0.5 if self.seen["calls"] > 2 else 1.0)


class StopGradient(Branching):
    """A target of its own weights without gradient (SimSiam, BYOL): the weight read with
    gradients on first, then again under torch.no_grad."""

    def forward(self, x):
        x = self.branched(x)
        online = self.lin(x)
        with torch.no_grad():
            target = x @ self.lin.weight.t()
        return online - target


class HalfRegion(Branching):
    """Its layer in a bfloat16 autocast region."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.lin(self.branched(x))


class KeepsStatistic(Branching):
    """Keeps its output's mean in a buffer under torch.no_grad, which no output reads."""

    def __init__(self, branches=False):
        super().__init__(branches)
        self.register_buffer("mean", torch.zeros(()))

    def forward(self, x):
        out = self.lin(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * out.mean())
        return out


@pytest.mark.parametrize("branches", [False, True])
@pytest.mark.parametrize(
    "model,said",
    [
        (Counted, "the model's forward sets calls"),
        (Phased, "the model's forward sets seen"),
        (Teacher, "reads teacher.weight with gradients off"),
        (StopGradient, "reads (lin.weight|a value computed from its parameters) with gradients off"),
        (HalfRegion, "runs a region under torch.autocast"),
    ],
)
def test_surgery_refuses_in_one_line_what_its_captured_graph_cannot_keep(branches, model, said):
    """A value the forward keeps and branches on (the capture's branch ran at every call: 0.67
    off from the third), a parameter read under torch.no_grad (a teacher's weights got gradients
    of 65; a stop-gradient target's, 0.66 off), an autocast region (float32 where the models give
    bfloat16): silently another training on both captures. vmap runs the first
    four as the models do."""
    from wide_tessera import fuse
    from wide_tessera.core.errors import NotApplicable

    models = [model(branches) for _ in range(3)]
    wide = fuse(copy.deepcopy(models), strategy="surgery")
    with pytest.raises(NotApplicable, match=said):
        wide(wide.pack([torch.randn(2, 4)] * 3))
    if model is HalfRegion:
        return
    vmapped = fuse(copy.deepcopy(models), strategy="vmap")
    for _ in range(3):
        xs = [torch.randn(2, 4) for _ in range(3)]
        for got, m, x in zip(vmapped.unpack(vmapped(vmapped.pack(xs))), models, xs):
            torch.testing.assert_close(got, m(x))


def test_a_dropout_layer_keeps_its_model_on_torch_fx_and_follows_train_and_eval():
    """nn.Dropout is called whole, reading its own mode at each call: traced through, its graph
    differs between train and eval and sent every model with one to torch.export (a capture of
    hundreds of milliseconds, and a slower call)."""
    from wide_tessera.widen.surgery import WideSurgery

    models = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)) for _ in range(3)]
    wide = WideSurgery(models, randomness="different")
    assert wide.captured is None and wide.looped == ["1"]
    x = torch.randn(3, 2, 4)
    wide.eval()
    for model in models:
        model.eval()
    torch.testing.assert_close(wide(x), torch.stack([m(part) for m, part in zip(models, x)]))
    wide.train()
    assert (wide(x) == 0).any()  # 24 draws at 1/2: none dropped once in 2**24


class BiasedAttention(nn.Module):
    """Attention given a bias it makes in forward, by keyword, the same for every model: one slope
    per head (ALiBi), [batch * heads, L, L]."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        distance = -(torch.arange(x.shape[1])[None, :] - torch.arange(x.shape[1])[:, None]).abs().float()
        bias = (torch.tensor([0.5, 0.0625])[:, None, None] * distance).repeat(x.shape[0], 1, 1)
        return self.mha(x, x, x, attn_mask=bias, need_weights=False)[0]


@pytest.mark.parametrize("n", [2, 3])
def test_a_tensor_every_model_shares_given_by_keyword_to_a_layer_under_vmap_is_given_to_each(n):
    """A layer surgery runs under vmap took a keyword tensor the models share as N models' own,
    mapped over its first axis: with N equal to batch * heads (2 here), each model ran another's
    head bias (an error of 0.126); with N=3, torch's error."""
    from wide_tessera import fuse

    models = [BiasedAttention() for _ in range(n)]
    wide = fuse(copy.deepcopy(models), strategy="surgery")
    xs = [torch.randn(1, 6, 8) for _ in range(n)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        torch.testing.assert_close(got, model(x))


def test_an_activation_in_place_on_an_input_every_model_shares_runs_as_the_models():
    """pack passes an input all models share once; nn.ReLU(inplace=True) wrote into it, and torch
    refused ("more than one element of the written-to tensor refers to a single memory location")."""
    from wide_tessera import fuse

    models = [nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)) for _ in range(2)]
    wide = fuse(copy.deepcopy(models), strategy="surgery")
    x = torch.randn(3, 4)
    got = wide.unpack(wide(wide.pack([x, x])))
    for out, model in zip(got, models):
        torch.testing.assert_close(out, model(x.clone()))


class SkipBeforeInPlace(nn.Module):
    """Keeps a skip, then activates in place: the skip is activated too, as torch runs it."""

    def __init__(self):
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        skip = h
        return self.out(self.act(h)) + skip


def test_an_activation_in_place_acts_on_what_else_holds_its_input():
    """Run out of place everywhere, the skip kept before it stayed as it was (1.71 off)."""
    from wide_tessera import fuse

    models = [SkipBeforeInPlace() for _ in range(3)]
    wide = fuse(copy.deepcopy(models), strategy="surgery")
    xs = [torch.randn(2, 4) for _ in range(3)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        torch.testing.assert_close(got, model(x))


def test_a_statistic_kept_under_no_grad_that_no_output_reads_is_not_refused():
    """torch.fx's graph computes it with gradients on, and nothing it returns reads it."""
    from wide_tessera import fuse

    models = [KeepsStatistic() for _ in range(3)]
    wide = fuse(copy.deepcopy(models), strategy="surgery")
    assert wide.runs.captured is None
    xs = [torch.randn(2, 4) for _ in range(3)]
    for got, model, x in zip(wide.unpack(wide(wide.pack(xs))), models, xs):
        torch.testing.assert_close(got, model(x))
    torch.testing.assert_close(wide.state_dicts()[1]["mean"], models[1].mean)
