"""Optuna studies whose trials train fused: the same trials and curves as Optuna's sequential
loop, groups that never mix shapes, pruning that frees its group mates, and bad input refused."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_tessera as wt
from wide_tessera.measurement.health import HealthMonitor

optuna = pytest.importorskip("optuna")
from wide_tessera.integrations.optuna import Training, optimize, sequential_objective  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
D, B, STEPS = 8, 16, 30


class MLP(nn.Module):
    def __init__(self, hidden=16, depth=2):
        super().__init__()
        widths = [D] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.out(x)


GEN = torch.Generator().manual_seed(0)
X = torch.randn(STEPS, B, D, generator=GEN)
Y = X.sum(-1, keepdim=True).sin()


def suggest(trial):
    return {
        "lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1),
    }


def build(params):
    return MLP(params.get("hidden", 16), params.get("depth", 2))


TRAINING = Training(steps=STEPS, batch=lambda params, step: (X[step], Y[step]), loss=F.mse_loss, optimizer="adamw",
                    clip=1.0, cosine=True, report_every=5)  # fmt: skip


def study(pruner=None):
    sampler = optuna.samplers.RandomSampler(seed=0)  # the same trials whatever was told: fused and sequential alike
    return optuna.create_study(sampler=sampler, pruner=pruner or optuna.pruners.NopPruner())


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_a_fused_study_runs_the_sequential_studys_trials_and_curves(strategy):
    sequential = study()
    sequential.optimize(sequential_objective(suggest, build, TRAINING), n_trials=6)
    fused = study()
    summary = optimize(fused, suggest, build, TRAINING, n_trials=6, group_size=3, strategy=strategy, progress=False)
    assert [len(g.trials) for g in summary.groups] == [3, 3] and {g.strategy for g in summary.groups} == {strategy}
    for a, b in zip(sequential.trials, fused.trials):
        assert a.params == b.params
        steps = sorted(a.intermediate_values)
        assert steps == sorted(b.intermediate_values) == [4, 9, 14, 19, 24, 29]
        want, got = [a.intermediate_values[s] for s in steps], [b.intermediate_values[s] for s in steps]
        assert got == pytest.approx(want, rel=1e-3)
        assert b.value == pytest.approx(a.value, rel=1e-3)
    assert fused.best_trial.number == sequential.best_trial.number
    frame = fused.trials_dataframe()
    assert len(frame) == 6 and set(frame["user_attrs_wide_tessera_strategy"]) == {strategy}


def test_groups_never_mix_shapes_and_the_summary_names_what_tells_them_apart():
    def shaped(trial):
        return {**suggest(trial), "hidden": trial.suggest_categorical("hidden", [8, 16]),
                "depth": trial.suggest_categorical("depth", [1, 2])}  # fmt: skip

    s = study()
    training = Training(steps=5, batch=TRAINING.batch, loss=F.mse_loss, report_every=5)
    summary = optimize(s, shaped, build, training, n_trials=16, group_size=4, strategy="vmap", progress=False)
    assert summary.shape_params == ["depth", "hidden"]
    by_number = {t.number: (t.params["hidden"], t.params["depth"]) for t in s.trials}
    for g in summary.groups:
        assert len({by_number[n] for n in g.trials}) == 1
    assert len({by_number[g.trials[0]] for g in summary.groups}) == 4
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in s.trials)


def test_a_batch_size_suggested_per_trial_groups_trials_by_it_and_trains_as_the_sequential_loop():
    """A batch size changes no model, but pack stacks the N inputs: trials of different batch
    sizes grouped together failed the whole study at their first step (found by a review)."""

    def batched(trial):
        return {**suggest(trial), "batch_size": trial.suggest_categorical("batch_size", [4, 16])}

    training = Training(steps=5, batch=lambda p, step: (X[step, : p["batch_size"]], Y[step, : p["batch_size"]]),
                        loss=F.mse_loss, optimizer="adam", report_every=5)  # fmt: skip
    sequential = study()
    sequential.optimize(sequential_objective(batched, build, training), n_trials=6)
    fused = study()
    summary = optimize(fused, batched, build, training, n_trials=6, group_size=3, strategy="vmap", progress=False)
    assert summary.shape_params == ["batch_size"]
    sizes = {t.number: t.params["batch_size"] for t in fused.trials}
    assert all(len({sizes[n] for n in g.trials}) == 1 for g in summary.groups)
    assert [t.value for t in fused.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-4)


def test_a_pruned_trial_leaves_its_group_and_the_survivors_train_on_unchanged():
    plain, pruned = study(), study(optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=4))
    optimize(plain, suggest, build, TRAINING, n_trials=9, group_size=3, strategy="surgery", progress=False)
    summary = optimize(pruned, suggest, build, TRAINING, n_trials=9, group_size=3, strategy="surgery", progress=False)
    gone = [n for g in summary.groups for n in g.pruned]
    assert gone and all(g.repacked for g in summary.groups if 0 < len(g.pruned) < len(g.trials))
    states = {t.number: t.state for t in pruned.trials}
    assert all(states[n] == optuna.trial.TrialState.PRUNED for n in gone)
    for a, b in zip(plain.trials, pruned.trials):
        if b.state == optuna.trial.TrialState.COMPLETE:  # a survivor: as if its group mates had not been pruned
            assert b.value == pytest.approx(a.value, rel=1e-3)
            assert [b.intermediate_values[s] for s in b.intermediate_values] == pytest.approx(
                [a.intermediate_values[s] for s in b.intermediate_values], rel=1e-3
            )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_trials=0), "n_trials=0: give a positive int"),
        (dict(group_size=0), "group_size=0: give a positive int"),
        (dict(study="study"), "give an optuna.Study"),
        (dict(suggest=lambda trial: [1]), "suggest\\(trial\\) returned list"),
        (dict(build=lambda params: "model"), "build\\(params\\) returned str"),
        (dict(strategy="vmapp"), "unknown strategy for MLP 'vmapp'"),
        (dict(study=optuna.create_study(directions=["minimize"] * 2)), "the study has 2 objectives"),
        (dict(training=Training(steps=2, batch=TRAINING.batch, loss=lambda o, y: 1.0)), "loss.*returned float"),
        # torch's AssertionError and RuntimeError
        (dict(device="tpu9"), "unknown device 'tpu9'"),
        (dict(device="cuda:99"), "device 'cuda:99'"),
        # a ValueError that did not name the seed, and a generator's overflow
        (dict(suggest=lambda trial: {"seed": "b"}), "trial 0: seed='b': give an int"),
        (dict(suggest=lambda trial: {"seed": 2**70}), f"seed={2**70}: give an int"),
    ],
)
def test_bad_input_is_one_line_before_any_training(kwargs, message):
    args = dict(study=study(), suggest=suggest, build=build, training=TRAINING, n_trials=2, group_size=2,
                strategy="vmap", progress=False)  # fmt: skip
    args.update(kwargs)
    with pytest.raises(wt.WideTesseraError, match=message):
        optimize(**args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(steps=0), "steps=0"),
        (dict(optimizer="lion"), "unknown optimizer 'lion'"),
        (dict(clip=-1), "clip=-1"),
        (dict(batch=[torch.zeros(40, 2)] * 3), "^Training: batch is a list, not a function$"),  # (printed whole)
    ],
)
def test_a_training_of_bad_settings_is_refused(kwargs, message):
    with pytest.raises(wt.WideTesseraError, match=message):
        Training(**{**dict(steps=5, batch=TRAINING.batch, loss=F.mse_loss), **kwargs})


@pytest.mark.slow
def test_a_measured_group_size_comes_from_the_table_it_wrote(tmp_path, monkeypatch):
    # a measurement disturbed throughout writes no entry, and the second study measured again
    # (beside two busy loops): here the machine is taken to be quiet
    monkeypatch.setattr(HealthMonitor, "round_disturbed", lambda self: False)
    monkeypatch.setattr(HealthMonitor, "busy", lambda self: False)
    table = tmp_path / "table.json"
    training = Training(steps=3, batch=TRAINING.batch, loss=F.mse_loss, report_every=3)
    summary = optimize(study(), suggest, build, training, n_trials=4, table=table, progress=False)
    (why,) = summary.sizes.values()
    assert table.exists() and str(table) in why
    if "on a quieter machine" in why:  # every N open: the next study rightly measures again
        pytest.skip(f"the first study decided nothing on this busy machine: {why}")
    written = table.read_bytes()

    def measure_again(*args, **kwargs):
        raise AssertionError("the second study measured what the table already said")

    monkeypatch.setattr("wide_tessera.integrations.optuna.sizing.benchmark_custom", measure_again)
    again = optimize(study(), suggest, build, training, n_trials=4, table=table, progress=False)
    (why_again,) = again.sizes.values()
    # the same verdicts from the same table; only the free memory the cap reads may differ
    assert why_again.split("), memory")[0] == why.split("), memory")[0]
    assert table.read_bytes() == written

    # The size is where fuse() fuses: a win at N=4 that N=8 does not confirm fuses nothing (fuse()
    # fuses N only where every larger measured N fused), and each group of the size runs fused.
    for verdicts, size, crossover in (("same fuse unconfirmed", 1, None), ("same fuse fuse", 8, 4)):
        document = json.loads(written)
        (entry,) = document["entries"]
        entry["verdicts"] = [
            {"n": n, "verdict": v, "strategy": "vmap" if v == "fuse" else None}
            for n, v in zip((2, 4, 8), verdicts.split())
        ]
        entry["crossover_n"] = crossover
        table.write_text(json.dumps(document))
        summary = optimize(study(), suggest, build, training, n_trials=8, table=table, progress=False)
        assert [len(g.trials) for g in summary.groups] == [size] * (8 // size), verdicts
        assert all((g.strategy == "vmap") == (size > 1) for g in summary.groups), verdicts


@pytest.mark.parametrize(
    "verdict, named, runs",
    [("fuse", "vmap", "vmap"), ("disturbed", "surgery", "surgery"), ("same", "vmap", "vmap"), ("failed", None, None)],
)
def test_the_group_size_asked_for_is_the_size_trained_with_the_strategy_the_table_names_at_it(
    verdict, named, runs, tmp_path, monkeypatch
):
    """group_size=4 alone ran the loop where the verdict at 4 was 'disturbed': now groups of 4 run
    the strategy the table names at N=4, whatever its verdict; where it names none (no strategy
    was correct), one line says so before any training and the groups of 4 run as a loop."""
    from wide_tessera.dispatch.fuse import DispatchWarning
    from wide_tessera.integrations.optuna import sizing

    monkeypatch.setattr(sizing, "_verdicts", lambda member, ns, table: {n: (False, verdict, named) for n in ns})
    training = Training(steps=3, batch=TRAINING.batch, loss=F.mse_loss, report_every=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = optimize(study(), suggest, build, training, n_trials=8, group_size=4, table=tmp_path / "t.json",
                           progress=False)  # fmt: skip
    assert [len(g.trials) for g in summary.groups] == [4, 4]
    assert [g.strategy for g in summary.groups] == [runs, runs]
    said = [str(w.message) for w in caught if issubclass(w.category, DispatchWarning)]
    assert len(said) == (runs is None) and all("group_size=4" in s and verdict in s for s in said)


def test_a_study_with_dropout_gives_the_same_values_run_after_run():
    """A trial's dropout masks come from its seed, not from whatever drew random numbers before the
    study: a seeded sampler's study, sequential or fused, is reproducible."""

    def dropped(params):
        return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

    training = Training(steps=6, batch=TRAINING.batch, loss=F.mse_loss, report_every=3)
    runs = []
    for _ in range(2):
        torch.rand(7)  # the caller's generator moved on between the two runs
        sequential, fused = study(), study()
        sequential.optimize(sequential_objective(suggest, dropped, training), n_trials=4)
        optimize(fused, suggest, dropped, training, n_trials=4, group_size=2, strategy="vmap", progress=False)
        runs.append([[t.value for t in s.trials] for s in (sequential, fused)])
    assert runs[0] == runs[1]


def test_trials_that_differ_only_in_a_dropout_rate_share_groups_and_train_as_the_loop_trains_them():
    """A rate is a hyperparameter, not a shape: a float drawn per trial made every trial a group of
    its own (8 trials, 103 s against 17 s sequential). Each trial's rate is its own in the group:
    tests/test_rates.py checks it against the separate models."""

    def rated(trial):
        return {**suggest(trial), "dropout": trial.suggest_float("dropout", 0.0, 0.5)}

    def dropped(params):
        return nn.Sequential(nn.Linear(D, 16), nn.LeakyReLU(params["dropout"] / 5), nn.Dropout(params["dropout"]),
                             nn.Linear(16, 1))  # fmt: skip

    training = Training(steps=6, batch=TRAINING.batch, loss=F.mse_loss, report_every=3)
    fused = study()
    summary = optimize(fused, rated, dropped, training, n_trials=6, group_size=3, strategy="vmap", progress=False)
    assert [len(g.trials) for g in summary.groups] == [3, 3] and summary.shape_params == []
    assert {g.strategy for g in summary.groups} == {"vmap"}
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in fused.trials)


def test_a_trial_draws_the_same_random_batches_alone_and_in_a_group():
    """batch() may draw random data: each trial draws it from its own stream, as it does alone,
    whatever its group mates draw (with one stream for the group, final values ended 71% apart)."""
    training = Training(steps=8, batch=lambda params, step: (torch.randn(B, D), torch.randn(B, 1)), loss=F.mse_loss,
                        optimizer="adamw", report_every=4)  # fmt: skip
    sequential, fused = study(), study()
    sequential.optimize(sequential_objective(suggest, build, training), n_trials=4)
    optimize(fused, suggest, build, training, n_trials=4, group_size=4, strategy="vmap", progress=False)
    assert [t.value for t in fused.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-5)


def test_a_trial_that_raises_is_failed_and_one_its_suggest_prunes_is_pruned_as_study_optimize_does():
    def pruned_second(trial):
        if trial.number == 1:
            raise optuna.TrialPruned()
        return suggest(trial)

    s = study()
    summary = optimize(s, pruned_second, build, TRAINING, n_trials=3, group_size=2, strategy="vmap", progress=False)
    assert [t.state.name for t in s.trials] == ["COMPLETE", "PRUNED", "COMPLETE"] and len(summary.groups) == 1
    assert str(summary).startswith("3 trials, 2 in 1 group(s), 1 of them fused, 1 pruned (1 by suggest)")
    assert [t.user_attrs["wide_tessera_group"] for t in s.trials if t.state.name == "COMPLETE"] == [0, 0]

    def negative_lr(trial):
        return {**suggest(trial), "lr": -1.0} if trial.number == 2 else suggest(trial)

    s = study()
    with pytest.raises(ValueError, match="-1.0"):
        optimize(s, negative_lr, build, TRAINING, n_trials=3, group_size=3, strategy="vmap", progress=False)
    assert [t.state.name for t in s.trials] == ["FAIL"] * 3  # asked, never told: none is left RUNNING


class _PrunesOddTrialsAtTheEnd(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return trial.number % 2 == 1 and max(trial.intermediate_values) == STEPS - 1


def test_a_trial_is_pruned_at_its_last_report_as_an_objective_prunes_it():
    sequential, fused = study(_PrunesOddTrialsAtTheEnd()), study(_PrunesOddTrialsAtTheEnd())
    sequential.optimize(sequential_objective(suggest, build, TRAINING), n_trials=4)
    optimize(fused, suggest, build, TRAINING, n_trials=4, group_size=4, strategy="vmap", progress=False)
    states = [[t.state.name for t in s.trials] for s in (sequential, fused)]
    assert states[0] == states[1] == ["COMPLETE", "PRUNED", "COMPLETE", "PRUNED"]


def test_sizing_leaves_the_trials_models_and_the_callers_generator_as_they_were():
    """Sizing a group calls the first trial's model once: on a copy, its BatchNorm statistics are
    the sequential study's (it counted one batch more), and the caller's generator does not move."""

    def normed(params):
        return nn.Sequential(nn.Linear(D, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))

    def batches_seen(model, params):
        return float(model[1].num_batches_tracked) + float(model[1].running_mean.abs().sum())

    training = Training(steps=6, batch=TRAINING.batch, loss=F.mse_loss, report_every=3, evaluate=batches_seen)
    sequential, fused = study(), study()
    sequential.optimize(sequential_objective(suggest, normed, training), n_trials=4)
    optimize(fused, suggest, normed, training, n_trials=4, group_size=2, strategy="vmap", progress=False)
    assert [t.value for t in fused.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-6)

    def dropped(params):
        return nn.Sequential(nn.Linear(D, 16), nn.Dropout(0.2), nn.Linear(16, 1))

    torch.manual_seed(123)
    optimize(study(), suggest, dropped, TRAINING, n_trials=4, group_size=2, strategy="vmap", progress=False)
    after = torch.rand(1)
    assert torch.equal(after, torch.manual_seed(123) and torch.rand(1))


def test_an_optimizer_setting_suggested_in_some_trials_only_takes_torchs_default_in_the_others():
    def conditional(trial):
        params = suggest(trial)
        if trial.suggest_categorical("use_momentum", [True, False]):
            params["momentum"] = trial.suggest_float("momentum", 0.5, 0.99)
        return params

    training = Training(steps=10, batch=TRAINING.batch, loss=F.mse_loss, optimizer="sgd", report_every=5)
    sequential, fused = study(), study()
    sequential.optimize(sequential_objective(conditional, build, training), n_trials=6)
    optimize(fused, conditional, build, training, n_trials=6, group_size=6, strategy="vmap", progress=False)
    assert {"momentum" in t.params for t in fused.trials} == {True, False}
    assert [t.value for t in fused.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-5)


def test_trials_run_one_at_a_time_train_exactly_as_the_sequential_loop_trains_them():
    sequential, alone = study(), study()
    sequential.optimize(sequential_objective(suggest, build, TRAINING), n_trials=3)
    summary = optimize(alone, suggest, build, TRAINING, n_trials=3, group_size=1, progress=False)
    assert [t.value for t in alone.trials] == [t.value for t in sequential.trials]  # bit for bit
    assert all(g.why == "one trial: nothing to fuse" and g.strategy is None for g in summary.groups)
