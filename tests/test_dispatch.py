"""Measured thresholds drive dispatch: the table `tune` writes, the rule that reads it, and `fuse`."""

import json
import warnings

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import wide_tessera as wt
from wide_tessera.cli import cli
from wide_tessera.core.capabilities import unmet_need
from wide_tessera.core.errors import WideTesseraError
from wide_tessera.dispatch import fuse as fusing
from wide_tessera.dispatch.build import LoopedModules
from wide_tessera.dispatch.fuse import DispatchWarning, fuse
from wide_tessera.dispatch.table import (
    DispatchTable,
    entries_of,
)
from wide_tessera.ops import AttentionBlock, Expert, WideConv1d, WideLinear
from wide_tessera.ops.registry import get_op, op_names
from wide_tessera.widen.custom import model_identity
from wide_tessera.widen.surgery import WideSurgery

from .helpers import entry


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """No test reads or writes the user's own table; each starts with no warnings given."""
    monkeypatch.setenv("WIDE_TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("WIDE_TESSERA_DISPATCH", raising=False)
    fusing._warned.clear()


def linears(n, d=32):
    return [nn.Linear(d, d) for _ in range(n)]


def assert_same_as_separate_calls(fused, modules, inputs):
    outputs = fused.unpack(fused(fused.pack(inputs)))
    assert len(outputs) == len(modules)
    with torch.no_grad():
        for out, m, x in zip(outputs, modules, inputs):
            ref = m(*x) if isinstance(x, tuple) else m(x)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# --- the decision rule, branch by branch, on synthetic tables --------------------------------


def test_fuses_where_the_table_says_fusing_won_and_loops_where_it_did_not():
    table = DispatchTable([entry()])
    fused = fuse(linears(8), table=table, batch=16)
    assert isinstance(fused.runs, WideLinear) and fused.strategy == "bmm" and fused.decision.fused
    looped = fuse(linears(2), table=table, batch=16)  # between N=1 (loop) and N=4: decided by N=1
    assert isinstance(looped.runs, LoopedModules) and not looped.decision.fused
    assert "N=1" in looped.decision.match.reason


def test_between_measured_n_it_fuses_only_if_every_larger_measured_n_fused_too():
    table = DispatchTable([entry(verdicts="loop:1 fuse:4 loop:16 fuse:64")])
    for n, expected in [(4, False), (8, False), (16, False), (32, False), (64, True), (128, True)]:
        assert fuse(linears(n), table=table, batch=16).decision.fused is expected, n
    assert "above the largest measured N" in " ".join(fuse(linears(128), table=table, batch=16).decision.match.notes)
    below = fuse(linears(2), table=DispatchTable([entry(verdicts="fuse:4 fuse:16")]), batch=16)
    assert not below.decision.fused and "below the smallest measured N" in below.decision.match.reason


def test_unconfirmed_unstable_and_disturbed_wins_never_fuse():
    for verdict in ("unconfirmed", "unstable", "disturbed", "same", "failed"):
        table = DispatchTable([entry(verdicts=f"{verdict}:4 {verdict}:16")])
        assert not fuse(linears(16), table=table, batch=16).decision.fused, verdict


def test_the_nearest_entry_decides():
    table = DispatchTable(
        [entry(params={"batch": 16, "in_features": 32, "out_features": 32}, verdicts="fuse:4 fuse:16"),
         entry(params={"batch": 1024, "in_features": 32, "out_features": 32}, verdicts="loop:4 loop:16")]
    )
    near_small = fuse(linears(16), table=table, batch=40)
    assert near_small.decision.fused and near_small.decision.match.entries[0].params["batch"] == 16
    near_large = fuse(linears(16), table=table, batch=512)
    assert not near_large.decision.fused and near_large.decision.match.entries[0].params["batch"] == 1024
    assert "batch 512 (measured 1024)" in str(near_large.decision)


def test_equally_near_entries_must_all_fuse():
    table = DispatchTable(
        [entry(params={"batch": 16, "in_features": 32, "out_features": 32}, verdicts="fuse:16"),
         entry(params={"batch": 64, "in_features": 32, "out_features": 32}, verdicts="loop:16")]
    )
    tied = fuse(linears(16), table=table, batch=32)  # ln 2 from both
    assert not tied.decision.fused and len(tied.decision.match.entries) == 2
    unknown_batch = fuse(linears(16), table=table)  # batch not given: both match
    assert not unknown_batch.decision.fused
    assert "not given, so any measured value matched: batch" in str(unknown_batch.decision)


def test_no_entry_warns_once_with_the_command_to_tune_and_loops():
    table = DispatchTable([entry(params={"batch": 16, "in_features": 512, "out_features": 32})])  # 16x away
    with pytest.warns(DispatchWarning, match=r"wide_tessera tune gemm --device cpu --set in_features=32"):
        fused = fuse(linears(8), table=table, batch=16)
    assert isinstance(fused.runs, LoopedModules)
    assert "more than 4x away" in str(fused.decision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same case again: no second warning
        fuse(linears(8), table=table, batch=16)


def test_entries_of_another_device_dtype_or_mode_are_ignored_with_a_note():
    other = DispatchTable([entry(device_name="NVIDIA H100 80GB HBM3")])
    with pytest.warns(DispatchWarning):
        fused = fuse(linears(16), table=other, batch=16)
    assert not fused.decision.fused
    assert "measured on NVIDIA H100 80GB HBM3, not" in str(fused.decision)
    training = DispatchTable([entry(mode="train_step")])
    inference = fuse(linears(16), table=training, batch=16)  # the same case as above: warned once already
    assert not inference.decision.fused and "no gemm entry in dtype=float32 mode=inference" in str(inference.decision)
    assert fuse(linears(16), table=training, batch=16, mode="train_step").decision.fused
    with pytest.warns(DispatchWarning, match="--mode train_step"):
        fuse(linears(16), table=DispatchTable([]), batch=16, mode="train_step")


def test_a_flag_that_differs_is_another_case():
    params = {"batch": 2, "seq_len": 64, "d_model": 32, "heads": 4, "causal": True}
    table = DispatchTable([entry(op="flash_attention", params=params, strategy="batch_fold")])
    blocks = [AttentionBlock(32, 4, causal=False) for _ in range(16)]
    with pytest.warns(DispatchWarning):
        assert not fuse(blocks, table=table, batch=2, seq_len=64).decision.fused
    causal = [AttentionBlock(32, 4, causal=True) for _ in range(16)]
    assert fuse(causal, table=table, batch=2, seq_len=64).decision.strategy == "batch_fold"


# --- every op, and any module ----------------------------------------------------------------


@pytest.mark.parametrize("name", op_names())
def test_fuse_works_for_every_registered_op(name):
    cls = get_op(name)
    params = next(cls.BENCHMARK_SWEEPS["ci"].param_grid())
    modules = [cls.bench_model(**params) for _ in range(3)]
    # one that needs nothing, else the first that runs here (lora's need their points' splits)
    needs = cls.STRATEGY_NEEDS
    strategy = next((s for s in cls.BENCHMARK_STRATEGIES if not needs.get(s)), None) or next(
        s for s in cls.BENCHMARK_STRATEGIES if unmet_need(needs.get(s), "cpu", torch.float32, params) is None
    )
    fixed = cls.module_params(modules[0])
    hints = {k: v for k, v in params.items() if k not in fixed and k != "dtype"}
    table = DispatchTable([entry(op=name, params={k: v for k, v in params.items() if k != "dtype"}, strategy=strategy,
                                 verdicts="fuse:2 fuse:4")])
    op = name if cls.FUSES is None else None  # moe_experts: Expert modules go to mlp unless told
    fused = fuse(modules, table=table, op=op, **hints)
    assert fused.decision.fused and isinstance(fused.runs, cls), fused.decision
    inputs = cls.bench_inputs(3, **params)
    for m in modules:
        m.eval()
    fused.eval()
    assert_same_as_separate_calls(fused, modules, inputs)


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def custom_key(model):
    """The parameters a custom model's entry is keyed by: its class, qualified, and its layers' shapes."""
    return {k: v for k, v in model_identity(model).items() if k != "class"}


def test_any_module_fuses_the_way_benchmark_custom_measured_it():
    table = DispatchTable([entry(op="TwoLayer", params=custom_key(TwoLayer()), strategy="surgery",
                                 verdicts="loop:1 fuse:4")])  # fmt: skip
    modules = [TwoLayer() for _ in range(4)]
    fused = fuse(modules, table=table)
    assert isinstance(fused.runs, WideSurgery) and fused.decision.strategy == "surgery"
    assert_same_as_separate_calls(fused, modules, [torch.randn(5, 16) for _ in range(4)])
    with pytest.raises(WideTesseraError, match="give no hints"):
        fuse(modules, table=table, batch=5)


def test_an_entry_of_a_custom_class_never_fuses_another_class_of_that_name_or_shape():
    class TwoLayer(nn.Module):  # the same name, another class
        def __init__(self, d=16):
            super().__init__()
            self.a, self.b = nn.Linear(d, 32), nn.Linear(32, 8)

        def forward(self, x):
            return self.b(self.a(x))

    key = custom_key(TwoLayer())
    table = DispatchTable([entry(op="TwoLayer", params=key, verdicts="fuse:2 fuse:4", strategy="vmap")])
    assert fuse([TwoLayer() for _ in range(4)], table=table).decision.strategy == "vmap"
    with pytest.warns(DispatchWarning):  # one warning for the case, however many modules fall back
        assert not fuse([TwoLayer(d=24) for _ in range(4)], table=table).decision.fused  # other shapes
        assert not fuse([globals()["TwoLayer"]() for _ in range(4)], table=table).decision.fused  # other class


class Gated(nn.Module):
    """Two inputs, one of them a keyword with a default: what a fused module must still take."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(16, 8), nn.Linear(4, 8), nn.Dropout(0.0)

    def forward(self, x, gate, scale=None):
        y = self.a(x) * torch.sigmoid(self.b(gate))
        return self.drop(y if scale is None else y * scale)


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
@pytest.mark.parametrize("train", [False, True])
def test_a_fused_module_of_several_inputs_takes_what_its_pack_gives(strategy, train):
    table = DispatchTable([entry(op="Gated", params=custom_key(Gated()), strategy=strategy, verdicts="fuse:2 fuse:4")])
    modules = [Gated().train(train) for _ in range(3)]
    fused = fuse(modules, table=table).train(train)
    assert fused.decision.strategy == strategy
    inputs = [(torch.randn(5, 16), torch.randn(5, 4)) for _ in range(3)]
    assert_same_as_separate_calls(fused, modules, inputs)
    by_keyword = [{"x": x, "gate": g} for x, g in inputs]
    outputs = fused.unpack(fused(fused.pack(by_keyword)))
    assert all(torch.allclose(o, m(**k), atol=1e-5) for o, m, k in zip(outputs, modules, by_keyword))
    sum(o.sum() for o in outputs).backward()  # it trains: the stacked weights get gradients
    assert all(p.grad is not None for p in fused.parameters())


def test_the_loop_keeps_the_interface_and_the_modules():
    modules = linears(3)
    with pytest.warns(DispatchWarning):
        looped = fuse(modules, table=DispatchTable([]), batch=4)
    assert list(looped.runs.models) == modules  # the user's own modules, not copies
    assert_same_as_separate_calls(looped, modules, [torch.randn(4, 32) for _ in range(3)])
    with pytest.raises(WideTesseraError, match="give a list of 3 inputs, one per model; got 1"):
        looped.pack([torch.randn(4, 32)])


def test_fuse_with_an_op_class_decides_for_that_op_and_from_modules_points_auto_there():
    table = DispatchTable([entry(op="conv1d", params={"batch": 4, "channels": 8, "kernel_size": 3, "length": 32},
                                 strategy="grouped", verdicts="loop:2 fuse:8")])
    convs = [nn.Conv1d(8, 8, 3, padding=1) for _ in range(8)]
    wide = fuse(convs, op=WideConv1d, table=table, batch=4, length=32)
    assert isinstance(wide.runs, WideConv1d) and wide.strategy == "grouped"
    assert "because: grouped won at measured N=8" in str(wide.decision)
    assert_same_as_separate_calls(wide, convs, [torch.randn(4, 8, 32) for _ in range(8)])
    two = fuse(convs[:2], op=WideConv1d, table=table, batch=4, length=32)
    assert isinstance(two.runs, LoopedModules)
    assert WideConv1d.from_modules(convs, strategy="vmap").strategy == "vmap"  # named strategies unchanged
    with pytest.raises(WideTesseraError, match=r"wide_tessera.fuse\(modules, op='conv1d'"):
        WideConv1d.from_modules(convs, strategy="auto")


# --- the table as a file ---------------------------------------------------------------------


def test_a_newer_measurement_replaces_the_older_one_and_others_stay(tmp_path):
    old = entry(verdicts="loop:4 loop:16", measured_at="2026-11-01T00:00:00+00:00")
    other = entry(params={"batch": 128, "in_features": 32, "out_features": 32})
    new = entry(verdicts="fuse:4 fuse:16", measured_at="2026-11-02T00:00:00+00:00")
    table = DispatchTable([old, other]).merged([new])
    assert len(table.entries) == 2 and new in table.entries and other in table.entries
    assert DispatchTable([new]).merged([old]).entries == [new]  # an older file merged later does not win
    path = tmp_path / "t.json"
    table.save(path)
    assert DispatchTable.load(path) == table


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "not JSON"),
        (json.dumps({"schema_version": 5, "results": []}), "not a wide_tessera dispatch table"),
        (json.dumps({"format": "wide_tessera dispatch table", "version": 99, "entries": []}), "version 99"),
        ("BAD_VERDICT", "verdict 'maybe'"),
        ("BAD_CROSSOVER", "does not follow from its verdicts"),
        ("BAD_TYPE", r"entries\[0\]\.threads: expected a int"),
    ],
)
def test_a_damaged_or_foreign_table_is_one_line_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "table.json"
    doc = DispatchTable([entry()]).to_dict()
    if content == "BAD_VERDICT":
        doc["entries"][0]["verdicts"][0]["verdict"] = "maybe"
    elif content == "BAD_CROSSOVER":
        doc["entries"][0]["crossover_n"] = 1
    elif content == "BAD_TYPE":
        doc["entries"][0]["threads"] = "two"
    path.write_text(json.dumps(doc) if content.startswith("BAD") else content)
    before = path.read_text()
    with pytest.raises(WideTesseraError, match=problem) as e:
        fuse(linears(4), table=str(path), batch=16)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    r = CliRunner().invoke(cli, ["tune", "gemm", "--preset", "ci", "-o", str(path)])
    assert r.exit_code == 2 and str(path) in r.output and "Traceback" not in r.output
    assert path.read_text() == before  # it may hold other measurements: never overwritten


def test_bad_arguments_are_one_line_errors():
    table = DispatchTable([entry()])
    cases = [
        (dict(modules=linears(2), batch="many"), "not a positive integer"),
        (dict(modules=linears(2), batchsize=4), "unknown hint for gemm 'batchsize'"),
        (dict(modules=linears(2), in_features=32), "the modules fix in_features=32"),
        (dict(modules=[nn.Linear(4, 4), nn.Conv1d(4, 4, 1)]), "all must be of one class"),
        (dict(modules=[]), "non-empty list of modules"),
        (dict(modules=linears(2), op="conv1d"), "fuses Conv1d modules, not Linear"),
        (dict(modules=linears(2), op="nope"), "unknown op 'nope'"),
        (dict(modules=linears(2), mode="training"), "training"),
        (dict(modules=linears(2), dtype="float16"), "dtype='float16' but the modules' parameters are float32"),
    ]
    for kwargs, message in cases:
        with pytest.raises(WideTesseraError, match=message):
            fuse(table=table, **kwargs)
    with pytest.raises(WideTesseraError, match="give a path or a DispatchTable"):
        fuse(linears(2), table=42)
    with pytest.raises(WideTesseraError, match="missing.json: cannot read"):
        fuse(linears(2), table="missing.json")


def test_the_default_table_comes_from_the_environment_else_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    DispatchTable([entry()]).save(path)
    monkeypatch.setenv("WIDE_TESSERA_DISPATCH", str(path))
    assert fuse(linears(16), batch=16).decision.table == str(path)
    monkeypatch.delenv("WIDE_TESSERA_DISPATCH")
    with pytest.warns(DispatchWarning, match="not written yet"):
        assert not fuse(linears(16), batch=16).decision.fused
    (tmp_path / "cache").mkdir()
    DispatchTable([entry()]).save(tmp_path / "cache" / "dispatch.json")
    assert fuse(linears(16), batch=16).decision.fused


# --- a real tune, then fuse -------------------------------------------------------------------


@pytest.mark.slow
def test_tune_then_fuse_chooses_what_was_measured(tmp_path):
    table_path, results_path = tmp_path / "table.json", tmp_path / "results.json"
    args = ["tune", "gemm", "--preset", "ci", "--device", "cpu", "--n-values", "1,16", "--set", "in_features=64",
            "--set", "out_features=64", "--budget", "0.05", "-o", str(table_path), "--results", str(results_path)]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"dispatch table {table_path}: gemm: 1 entry" in r.output
    [result] = wt.load_results(results_path)
    assert result.confirm == "all" and all(p.confirmation is not None for p in result.points if p.timings)
    [tuned] = DispatchTable.load(table_path).entries
    assert tuned.params == {"batch": 16, "in_features": 64, "out_features": 64} and tuned.mode == "inference"
    for measured in tuned.verdicts:
        modules = linears(measured.n, d=64)
        fused = fuse(modules, table=str(table_path), batch=16)
        assert fused.decision.fused == (measured.verdict == "fuse" and tuned.crossover_n is not None
                                        and measured.n >= tuned.crossover_n)
        if fused.decision.fused:
            assert fused.strategy == measured.strategy
        assert_same_as_separate_calls(fused, modules, [torch.randn(16, 64) for _ in range(measured.n)])
    again = CliRunner().invoke(cli, [*args[:-2]], catch_exceptions=False)  # merges: still one entry, the newer
    assert again.exit_code == 0
    assert len(DispatchTable.load(table_path).entries) == 1


def test_unconfirmed_wins_enter_a_table_as_unconfirmed():
    result = wt.benchmark("gemm", preset="ci", device="cpu", verbose=False, n_values=[16], confirm="none",
                          timing=wt.TimingConfig(budget_s=0.05))
    [e] = entries_of(result)
    point = result.points[0]
    assert e.verdicts[0].verdict != "fuse" and e.crossover_n is None  # nothing confirmed it
    if point.fused_wins:
        assert e.verdicts[0].verdict == "unconfirmed"


def test_tune_without_a_table_writes_the_per_user_cache(tmp_path):
    r = CliRunner().invoke(
        cli,
        ["tune", "layernorm", "--preset", "ci", "--n-values", "1", "--budget", "0.01", "--quiet"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    [written] = DispatchTable.load(tmp_path / "cache" / "dispatch.json").entries
    assert written.op == "layernorm" and [v.n for v in written.verdicts] == [1]


def test_equally_near_entries_that_won_with_different_strategies_do_not_fuse():
    params = {"tokens": 16, "d_model": 16, "hidden": 32}
    table = DispatchTable(
        [entry(op="moe_experts", params={**params, "skew": 0.0}, strategy="padded", verdicts="fuse:8"),
         entry(op="moe_experts", params={**params, "skew": 1.0}, strategy="grouped_mm", verdicts="fuse:8")]
    )
    experts = [Expert(16, 32) for _ in range(8)]
    unsure = fuse(experts, table=table, op="moe_experts", tokens=16)
    assert not unsure.decision.fused
    assert "different strategies (grouped_mm, padded): give skew to choose" in unsure.decision.match.reason
    assert "skew=0.0: padded won" in unsure.decision.match.reason
    told = fuse(experts, table=table, op="moe_experts", tokens=16, skew=1.0)
    assert told.decision.strategy == "grouped_mm"


def test_a_winner_that_cannot_run_here_is_not_built():
    table = DispatchTable([entry(strategy="triton")])  # as if measured here with a GPU and triton
    looped = fuse(linears(16), table=table, batch=16)
    assert isinstance(looped.runs, LoopedModules)
    assert "but triton needs a CUDA device" in looped.decision.match.reason


def test_a_cpu_entry_measured_with_other_threads_says_so():
    table = DispatchTable([entry(threads=torch.get_num_threads() + 1)])
    decided = fuse(linears(16), table=table, batch=16)
    assert decided.decision.fused  # the thread count is not matched on, but the decision says it differs
    assert f"measured with {torch.get_num_threads() + 1} torch thread(s)" in str(decided.decision)
    same = fuse(linears(16), table=DispatchTable([entry(threads=torch.get_num_threads())]), batch=16)
    assert "torch thread" not in str(same.decision)


def test_fuse_never_breaks_the_model_and_only_refuses_what_cannot_run():
    table = DispatchTable([])
    with pytest.warns(DispatchWarning, match="float64 is not one wide_tessera measures"):
        doubles = fuse([nn.Linear(7, 3).double() for _ in range(4)], table=table)
    assert isinstance(doubles.runs, LoopedModules) and "float64" in str(doubles.decision)
    mixed = [nn.Linear(4, 4) for _ in range(3)]
    mixed[1].eval()
    with pytest.warns(DispatchWarning, match="some of the modules are in train mode and some in eval mode"):
        assert isinstance(fuse(mixed, table=table).runs, LoopedModules)
    with pytest.warns(DispatchWarning, match="no measured entry"):  # a shape nothing measured
        assert isinstance(fuse([nn.Linear(5, 9) for _ in range(2)], table=table, batch=3).runs, LoopedModules)
    with pytest.raises(WideTesseraError, match="non-empty list"):
        fuse([], table=table)
    with pytest.raises(WideTesseraError, match="all must be of one class"):
        fuse([nn.Linear(4, 4), nn.Conv1d(4, 4, 3)], table=table)
    with pytest.raises(
        WideTesseraError, match=r"module 1's 'weight' is \[5, 4\] float32 on cpu but module 0's is \[4, 4\]"
    ):
        fuse([nn.Linear(4, 4), nn.Linear(4, 5)], table=table)
    with pytest.raises(WideTesseraError, match="cuda_graph='yes': give True or False"):
        fuse([nn.Linear(4, 4)], table=table, cuda_graph="yes")


def test_tune_says_an_op_it_stopped_early_is_not_in_the_table(tmp_path, monkeypatch):
    """An op whose first points were all disturbed stops there, incomplete, and its entries stay
    out of the table: tune left it out silently, and examples/moe.py then failed reading a table
    that was never written."""
    from wide_tessera.measurement.health import HealthMonitor

    monkeypatch.setattr(HealthMonitor, "round_disturbed", lambda self: True)
    table_path = tmp_path / "table.json"
    args = ["tune", "gemm", "--preset", "ci", "--device", "cpu", "--n-values", "1,2,4,8", "--budget", "0.02",
            "-o", str(table_path), "--results", str(tmp_path / "results.json")]  # fmt: skip
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert f"dispatch table {table_path}: gemm not merged: its run stopped before every point was measured" in (
        r.output
    ), r.output
    assert not table_path.exists()
