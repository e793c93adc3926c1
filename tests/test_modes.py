"""The modes: what one timed call does (inference, forward, backward, forward_backward,
train_step), and the training-mode check of gradients, running statistics and updated parameters."""

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from wide_tessera import benchmark, benchmark_custom
from wide_tessera.cli import cli
from wide_tessera.core import trees
from wide_tessera.core.errors import WideTesseraError
from wide_tessera.core.job import SweepParams
from wide_tessera.measurement import modes
from wide_tessera.ops import WideBatchNorm2d, WideLinear
from wide_tessera.ops.registry import op_names
from wide_tessera.sweep.runner import run


class LinearBatchNorm(nn.Module):
    """Linear then BatchNorm1d: in train mode each call updates the running statistics."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


class LinearDropout(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc, self.drop = nn.Linear(d, d), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


class BadGradientLinear(WideLinear):
    """Wide linears whose outputs are right and whose gradients are not."""

    BENCHMARK_STRATEGIES = ("bmm", "frozen_weight", "detached_input")
    BENCHMARK_SWEEPS = {"test": SweepParams.of([2], batch=[4], in_features=[8], out_features=[8])}

    def forward(self, x):
        weight = self.weight.detach() if self.strategy == "frozen_weight" else self.weight
        x = x.detach() if self.strategy == "detached_input" else x
        return torch.baddbmm(self.bias.unsqueeze(1), x, weight.transpose(1, 2))


@pytest.mark.parametrize("name", op_names())
def test_every_op_trains_as_its_n_models_do(name, fast_timing):
    """train_step checks outputs, input and parameter gradients, buffers and updated parameters."""
    r = benchmark(
        name,
        preset="ci",
        device="cpu",
        n_values=[2],
        mode="train_step",
        verbose=False,
        timing=fast_timing,
        confirm="none",
    )
    assert r.mode == "train_step"
    for p in r.points:
        ran = [s for s in r.strategies if p.failures.get(s) is None or p.failures[s].kind != "skipped"]
        assert ran and all(p.correct.get(s) for s in ran), (p.params, p.checks, p.failures)
        assert set(ran) <= set(p.timings)


@pytest.mark.parametrize("mode", modes.MODES)
def test_each_mode_is_timed_checked_and_recorded(mode, fast_timing):
    # N=2: the train mode's N pairs of betas read two ways for two models, and were refused
    r = benchmark("gemm", preset="ci", device="cpu", n_values=[2, 4], mode=mode, verbose=False, timing=fast_timing)
    assert r.mode == mode and r.all_correct
    assert {row["mode"] for row in r.to_rows()} == {mode}
    assert all({"baseline", "bmm", "einsum"} <= set(p.timings) for p in r.points)


@pytest.mark.parametrize(
    "mode, strategy, what",
    [
        ("forward_backward", "frozen_weight", "parameter gradient: weight"),
        ("train_step", "frozen_weight", "parameter gradient: weight"),
        ("backward", "detached_input", "input gradient"),
    ],
)
def test_a_wrong_gradient_is_incorrect_and_excluded(mode, strategy, what, fast_timing):
    job = BadGradientLinear.benchmark_job("test")
    r = run(job, timing=fast_timing, verbose=False, confirm="none", mode=mode)
    p = r.points[0]
    assert p.correct["bmm"] and not p.correct[strategy]
    assert p.checks[strategy].error.startswith(what), p.checks[strategy].error
    assert strategy not in p.timings and p.winner != strategy


def test_the_wrong_gradients_are_right_for_inference(fast_timing):
    r = run(BadGradientLinear.benchmark_job("test"), timing=fast_timing, verbose=False, confirm="none")
    assert r.all_correct and r.mode == "inference"


@pytest.mark.parametrize("mode", ["forward", "backward", "train_step"])
def test_batch_norm_running_statistics_are_checked_per_model(mode, fast_timing):
    r = benchmark_custom(
        LinearBatchNorm, (8, 16), [2, 4], mode=mode, verbose=False, timing=fast_timing, confirm="none"
    )
    assert r.all_correct, r.failures
    assert all({"vmap", "surgery"} <= set(p.timings) for p in r.points)


class StaleStatisticsBatchNorm(WideBatchNorm2d):
    """Wide batch norms whose outputs and gradients are right and whose running statistics are
    never updated: 'frozen' normalizes with the batch's statistics and leaves the running ones."""

    BENCHMARK_STRATEGIES = ("stacked", "frozen")
    BENCHMARK_SWEEPS = {"test": SweepParams.of([2], batch=[4], channels=[3], size=[5])}

    def _normalize(self, x, n, weight, bias, mean, var):
        if self.strategy == "frozen":
            mean, var = None, None
        return super()._normalize(x, n, weight, bias, mean, var)


@pytest.mark.parametrize("mode", ["forward", "train_step"])
def test_a_batch_norm_that_does_not_update_its_running_statistics_is_caught(mode, fast_timing):
    r = run(
        StaleStatisticsBatchNorm.benchmark_job("test"), mode=mode, timing=fast_timing, verbose=False, confirm="none"
    )
    (point,) = r.points
    assert point.correct["stacked"] and not point.correct["frozen"]
    assert point.checks["frozen"].error.startswith("buffer: running_mean"), point.checks["frozen"].error
    inference = run(StaleStatisticsBatchNorm.benchmark_job("test"), timing=fast_timing, verbose=False, confirm="none")
    assert not inference.points[0].correct["frozen"]  # in eval, the batch's statistics are not the running ones


@pytest.mark.parametrize("op", ["gru", "lstm"])
def test_recurrent_ops_train_over_several_sequence_lengths(op, fast_timing):
    r = benchmark(
        op, preset="ci", device="cpu", n_values=[3], mode="train_step", seq_len=[1, 5], hidden=[6],
        verbose=False, timing=fast_timing, confirm="none",
    )
    assert [p.params["seq_len"] for p in r.points] == [1, 5]
    assert r.all_correct and all({"fused_cell", "block_diagonal"} <= set(p.timings) for p in r.points), r.failures


def _batch_norm_outcomes(mode):
    torch.manual_seed(0)
    models = [LinearBatchNorm().train() for _ in range(2)]
    inputs = [torch.randn(8, 16) for _ in range(2)]
    side = modes.Side(lambda xs: [m(x) for m, x in zip(models, xs)], list, list, models)
    weights = modes.grad_weights([m(x).detach() for m, x in zip(copy.deepcopy(models), inputs)], 0)
    before = [m.bn.running_mean.clone() for m in models]
    outcome = modes.outcome(mode, side, inputs, weights, lambda call: call())
    assert all(torch.equal(m.bn.running_mean, b) for m, b in zip(models, before)), (
        "outcome must leave the models as they were"
    )
    return outcome, models


@pytest.mark.parametrize(
    "field, key, what",
    [
        ("buffers", "bn.running_var", "buffer: model 1 bn.running_var"),
        ("stepped", "fc.weight", "updated parameter: model 1 fc.weight"),
        ("grads", "bn.bias", "parameter gradient: model 1 bn.bias"),
    ],
)
def test_a_state_that_differs_from_the_models_fails_the_check(field, key, what):
    reference, models = _batch_norm_outcomes("train_step")
    assert modes.compare(reference, copy.deepcopy(reference), models, None, 1e-4).correct
    wrong = copy.deepcopy(reference)
    getattr(wrong, field)[1][key] += 0.01
    check = modes.compare(reference, wrong, models, None, 1e-4)
    assert not check.correct and check.error.startswith(what), check.error


class FrozenFirstLayer(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc, self.out = nn.Linear(d, d), nn.Linear(d, 4)
        self.fc.weight.requires_grad_(False)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def test_a_layer_frozen_in_the_models_stays_frozen_when_fused(fast_timing):
    r = benchmark_custom(
        FrozenFirstLayer, (4, 8), [3], mode="train_step", verbose=False, timing=fast_timing, confirm="none"
    )
    assert r.all_correct, {
        s: c.error for s, c in r.points[0].checks.items()
    }  # surgery trained the frozen weight before
    linears = [nn.Linear(4, 4) for _ in range(3)]
    for m in linears:
        m.weight.requires_grad_(False)
    wide = WideLinear.from_modules(linears, "bmm")
    assert (wide.weight.requires_grad, wide.bias.requires_grad) == (False, True)
    linears[0].weight.requires_grad_(True)
    with pytest.raises(WideTesseraError, match="'weight' is frozen in some of the models and not in others"):
        WideLinear.from_modules(linears, "bmm")


class Jittered(nn.Module):
    """Writes its input in place, as transformers' SwitchTransformersSparseMLP's router jitter does in training."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x *= 1.5
        return self.fc(x)


@pytest.mark.parametrize("mode", ["forward_backward", "train_step", "backward"])
def test_a_model_that_writes_its_input_in_place_trains_as_a_layer_in_a_model_does(mode, fast_timing):
    """Its input is an earlier layer's output in a model, which it may write; the training modes
    gave it a leaf that needs gradients, which torch refuses to write, so the point failed."""
    r = benchmark_custom(Jittered, (4, 8), [2], mode=mode, verbose=False, timing=fast_timing, confirm="none")
    p = r.points[0]
    assert not p.failures and p.correct == {"vmap": True, "surgery": True} and "baseline" in p.timings, p.failures
    models = [Jittered(), Jittered()]
    side = modes.Side(lambda xs: [m(x) for m, x in zip(models, xs)], list, list, models)
    inputs = [torch.randn(4, 8) for _ in models]
    with torch.no_grad():  # as a point is measured
        got = modes.outcome(mode, side, inputs, [torch.ones(4, 8)] * 2, lambda call: call())
    assert got.input_written and all(g.abs().sum() > 0 for g in got.input_grads)  # they reach the inputs


def test_dropout_is_checked_with_the_same_draws(fast_timing):
    """Each model's call and the wide call start from one generator state (randomness 'same')."""
    r = benchmark_custom(
        LinearDropout,
        (8, 16),
        [2],
        mode="forward_backward",
        randomness="same",
        verbose=False,
        timing=fast_timing,
        confirm="none",
    )
    assert r.all_correct and all(c.max_rel_error == 0.0 for p in r.points for c in p.checks.values())


def test_a_training_mode_finds_dropout_the_inference_run_did_not_see():
    with pytest.raises(WideTesseraError, match="draws random numbers"):
        benchmark_custom(LinearDropout, (8, 16), [2], mode="train_step", verbose=False)


def test_a_bad_mode_is_one_clear_error_before_measuring():
    with pytest.raises(WideTesseraError, match="unknown mode 'training'.*train_step"):
        benchmark("gemm", preset="ci", device="cpu", mode="training", verbose=False)
    result = CliRunner().invoke(cli, ["benchmark", "gemm", "--preset", "ci", "--mode", "training"])
    assert result.exit_code == 2 and "'training' is not one of" in result.output and "Traceback" not in result.output


def test_backward_mode_cannot_be_compiled():
    with pytest.raises(WideTesseraError, match="--mode backward.*forward_backward"):
        benchmark("gemm", preset="ci", device="cpu", mode="backward", compile="default", verbose=False)


def test_resume_refuses_another_mode(tmp_path):
    out = tmp_path / "r.json"
    args = ["benchmark", "gemm", "--preset", "ci", "--n-values", "1", "--budget", "0.01", "--quiet", "-o", str(out)]
    assert CliRunner().invoke(cli, [*args, "--mode", "forward"]).exit_code == 0
    assert json.loads(out.read_text())["results"][0]["settings"]["mode"] == "forward"
    result = CliRunner().invoke(cli, [*args, "--resume"])
    assert result.exit_code == 2 and "mode forward" in result.output and "mode inference" in result.output


def test_training_leaves_inputs_and_integer_ids_alone():
    """Float inputs become fresh leaves that need gradients; token ids stay integers without."""
    ids, x = torch.tensor([1, 2]), torch.randn(2)
    made = modes.requiring_grad((ids, x))
    assert not made[0].requires_grad and made[1].requires_grad and not x.requires_grad
    assert trees.tensors(made)[0].dtype == torch.int64
