"""The Python API as a user calls it: benchmark, benchmark_custom, measure, save/load, bad input."""

import dataclasses
import json

import pytest
import torch
from torch import nn

from wide_tessera import (
    WideTesseraError,
    benchmark,
    benchmark_custom,
    load_results,
)
from wide_tessera.measurement import settings
from wide_tessera.results.schema import SCHEMA_VERSION, save_results

from .helpers import Expert


@pytest.fixture(autouse=True)
def _fast_runs(monkeypatch, fast_timing):
    """benchmark() takes no timing config; shorten the runner's default for these tests."""
    monkeypatch.setattr(settings, "default_timing", lambda preset=None: fast_timing)


class NormedConv(nn.Module):
    """Has buffers (BatchNorm running stats), which must be stacked too."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv1d(4, 4, 3, padding=1), nn.BatchNorm1d(4)
        self.norm.running_mean.uniform_(-1, 1)

    def forward(self, x):
        return self.norm(self.conv(x))


@pytest.mark.slow
def test_benchmark_overrides_replace_sweep_values():
    r = benchmark("conv1d", preset="ci", device="cpu", verbose=False, n_values=[2, 3], channels=[4], length=16)
    assert [p.n for p in r.points] == [2, 3]
    assert all(p.params["channels"] == 4 and p.params["length"] == 16 for p in r.points)
    assert r.op == "conv1d" and r.preset == "ci" and r.device == "cpu" and r.all_correct


def test_alias_and_default_device():
    r = benchmark("linear", preset="ci", verbose=False, n_values=[2])
    assert r.op == "gemm"
    assert r.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_one_typed_settings_object_runs_as_its_keywords_do_and_carries_its_preset(fast_timing):
    """RunSettings.of(preset=..., ...) given as settings= is the run's, kept for several runs: the
    same settings as the keywords make, the preset its own; benchmark_custom's preset is 'custom'."""
    kept = settings.RunSettings.of(preset="ci", seed=3, confirm="none", timing=fast_timing)
    typed = benchmark("gemm", settings=kept, verbose=False, n_values=[2])
    keywords = benchmark("gemm", "ci", seed=3, confirm="none", timing=fast_timing, verbose=False, n_values=[2])
    assert typed.preset == "ci" and typed.settings == keywords.settings and typed.settings.seed == 3
    custom = benchmark_custom(Expert, (5, 16), [2], settings=settings.RunSettings(seed=5, timing=fast_timing),
                              verbose=False)  # fmt: skip
    assert custom.settings.preset == "custom" and custom.settings.seed == 5


@pytest.mark.parametrize("model,shape,kwargs", [(Expert, (5, 16), {"hidden": 24}), (NormedConv, (2, 4, 10), {})])
@pytest.mark.slow
def test_benchmark_custom_fuses_any_module(model, shape, kwargs):
    r = benchmark_custom(model, shape, [1, 3], device="cpu", verbose=False, model_kwargs=kwargs)
    assert r.op == model.__name__ and r.strategies == ["vmap", "surgery"]  # named after the class, not "custom"
    assert [p.n for p in r.points] == [1, 3]
    assert all(p.correct == {"vmap": True, "surgery": True} for p in r.points)


def test_benchmark_custom_refuses_a_random_module_without_a_randomness_mode():
    class Noisy(nn.Module):
        """Draws random numbers in forward, which torch.func.vmap refuses by default."""

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x * self.w + torch.randn(x.shape)

    with pytest.raises(WideTesseraError, match="Noisy draws random numbers.*randomness='different'"):
        benchmark_custom(Noisy, (2, 4), [2], verbose=False, device="cpu")
    r = benchmark_custom(Noisy, (2, 4), [2], verbose=False, device="cpu", randomness="different")
    assert r.points[0].correct == {"vmap": True, "surgery": True} and r.points[0].params["randomness"] == "different"


class _OwnNorm(nn.LayerNorm):
    """A LayerNorm whose forward is its own: not the op's computation, so surgery leaves it to vmap."""

    def forward(self, x):
        return super().forward(x) * 2


class _Swapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(16, 8), nn.Linear(8, 16), _OwnNorm(16)

    def forward(self, x):
        return self.norm(self.b(torch.softmax(self.a(x), -1)))


class _Counted(_Swapped):
    """Counts its rows in Python: torch.fx cannot trace range() of a proxy; torch.export can."""

    def forward(self, x):
        return super().forward(x) + sum(x[i] for i in range(x.shape[0]))


@pytest.mark.parametrize(
    "model,capture,vmapped",
    [(_Swapped, "torch.fx graph:", "calls under vmap: softmax x1"), (_Counted, "torch.export graph (torch.fx: ", "")],
)
def test_benchmark_custom_says_which_layers_surgery_swapped_and_which_went_to_vmap(tmp_path, model, capture, vmapped):
    r = benchmark_custom(model, (4, 16), [2, 3], device="cpu", verbose=False)
    ran = {p.checks["surgery"].ran for p in r.points}
    assert len(ran) == 1, ran
    line = ran.pop()
    assert line.startswith(capture) and "swapped 2 layers (Linear x2)" in line
    assert "under vmap 1 layers (_OwnNorm x1)" in line
    assert vmapped in line
    assert r.points[0].checks["vmap"].ran is None  # vmap gives no account of itself
    assert f"surgery ran: {line} (N=2,3)" in r.summary()
    r.save(tmp_path / "r.json")
    assert load_results(tmp_path / "r.json")[0].points[1].checks["surgery"].ran == line


def _differences(saved, loaded, where="result"):
    """Where two results differ, types included: == holds between 18 and 18.0, and between a
    str and torch's TorchVersion, yet a loaded result must be the saved one as it was."""
    if type(saved) is not type(loaded):
        return [f"{where}: {saved!r} ({type(saved).__name__}) became {loaded!r} ({type(loaded).__name__})"]
    if dataclasses.is_dataclass(saved):
        fields = [f.name for f in dataclasses.fields(saved)]
        return [d for f in fields for d in _differences(getattr(saved, f), getattr(loaded, f), f"{where}.{f}")]
    if isinstance(saved, dict):
        if saved.keys() != loaded.keys():
            return [f"{where}: keys {sorted(saved)} became {sorted(loaded)}"]
        return [d for k in saved for d in _differences(saved[k], loaded[k], f"{where}[{k!r}]")]
    if isinstance(saved, (list, tuple)):
        if len(saved) != len(loaded):
            return [f"{where}: {len(saved)} items became {len(loaded)}"]
        return [d for i, (a, b) in enumerate(zip(saved, loaded)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if saved == loaded else [f"{where}: {saved!r} became {loaded!r}"]


@pytest.mark.parametrize("op,sweep", [("gemm", {"n_values": [1, 2]}), ("flash_attention", {})])
def test_save_load_round_trip_is_exact(tmp_path, op, sweep):
    r = benchmark(op, preset="ci", device="cpu", verbose=False, **sweep)
    path = tmp_path / "r.json"
    r.save(path)
    (loaded,) = load_results(path)
    assert _differences(r, loaded) == []
    assert loaded.summary() == r.summary()
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["results"][0]["points"][0]["timings"]["baseline"] > 0


def test_load_results_reads_a_multi_op_file(tmp_path):
    rs = [benchmark(op, preset="ci", device="cpu", verbose=False, n_values=[1]) for op in ("gemm", "conv2d")]
    save_results(rs, tmp_path / "all.json")
    assert load_results(tmp_path / "all.json") == rs


@pytest.mark.parametrize(
    "content,match", [("{", "not a wide_tessera results file"), ('{"schema_version": 99}', "schema version 99")]
)
def test_load_rejects_bad_files(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(WideTesseraError, match=match):
        load_results(path)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: benchmark("conv1", preset="ci"), "unknown op 'conv1'; did you mean 'conv1d'"),
        (lambda: benchmark("gemm", preset="fast"), "unknown preset for gemm 'fast'.*valid: ci, quick, full"),
        (lambda: benchmark("gemm", preset="ci", chanels=[4]), "'chanels'.*in_features"),
        (lambda: benchmark("gemm", preset="ci", sed=3), "'sed'; did you mean 'seed'.*seed.*in_features"),
        (lambda: benchmark("gemm", preset="ci", n_values=[0, 4]), "n_values: 0 is not a positive integer"),
        (lambda: benchmark("gemm", preset="ci", n_values=[2.5]), "n_values: 2.5 is not a positive integer"),
        (lambda: benchmark("gemm", preset="ci", n_values=[]), "n_values: empty list"),
        (lambda: benchmark("gemm", preset="ci", batch=[-3]), "batch: -3 is not a positive integer"),
        (lambda: benchmark("gemm", preset="ci", dtype=["float64"]), "unknown dtype 'float64'"),
        (lambda: benchmark("flash_attention", preset="ci", causal=["yes"]), "causal: 'yes' is not True or False"),
        (lambda: benchmark("gemm", preset="ci", device="tpu"), "unknown device 'tpu'"),
        (lambda: benchmark_custom(Expert, (5, 17), [2]), r"input_shape \(5, 17\) does not fit Expert"),
        (lambda: benchmark_custom(Expert, (5, 0), [2]), "input_shape must be a non-empty tuple of positive ints"),
        (lambda: benchmark_custom(Expert, (5, 16), [-1]), "n_values: -1 is not a positive integer"),
        (
            lambda: benchmark_custom(Expert, (5, 16), [2], model_kwargs={"width": 3}),
            r"cannot build Expert\(\*\*\{'width': 3\}\)",
        ),
        (
            lambda: benchmark_custom(Expert, (5, 16), [2], hidden=8),
            r"hidden=8 is not a run setting .*model_kwargs=\{'hidden': 8\}",
        ),
        (lambda: benchmark_custom(Expert, (5, 16), [2], model_kwargs=[8]), r"model_kwargs=\[8\]: give a dict"),
        (lambda: benchmark_custom("Expert", (5, 16), [2]), "model_class='Expert' is not callable; pass an nn.Module"),
    ],
)
def test_bad_input_names_the_bad_value(call, match):
    with pytest.raises(WideTesseraError, match=match):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(WideTesseraError, match="CUDA is not available on this machine"):
        benchmark("gemm", preset="ci", device="cuda")


def test_the_public_surface_names_the_settings_the_errors_and_optim_in_a_fresh_process():
    """`import wide_tessera as wt` alone reaches RunSettings, every exception a user may catch,
    and wt.optim: optim used to be there only after something else had imported it."""
    import subprocess
    import sys

    code = (
        "import wide_tessera as wt\n"
        "from wide_tessera.core import errors\n"
        "from wide_tessera.measurement.settings import RunSettings\n"
        "assert wt.RunSettings is RunSettings\n"
        "for name in errors.__all__:\n"
        "    obj = getattr(errors, name)\n"
        "    if isinstance(obj, type) and issubclass(obj, BaseException):\n"
        "        assert getattr(wt, name) is obj, name\n"
        "assert wt.optim.AdamW.__name__ == 'AdamW'\n"
        "assert 'optim' in dir(wt)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
