"""Optuna studies whose trials train fused: the same trials and curves as Optuna's sequential
loop, groups that never mix shapes, pruning that frees its group mates, and bad input refused."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_tessera as wt
from wide_tessera.core.errors import WideTesseraError

optuna = pytest.importorskip("optuna")
from wide_tessera.integrations.optuna import Training, optimize, sequential_objective  # noqa: E402
from wide_tessera.integrations.optuna.probe import BASELINE, STRATEGIES, TURN_STEPS  # noqa: E402

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


def _warm_up_then_cosine(optimizer, params):
    """A warm-up chain as one writes it for one model, its length the trial's."""
    warm = params["warm_up"]
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS - warm)], milestones=[warm])  # fmt: skip


def _with(**drawn):
    """suggest, and each of `drawn` (name: (low, high)) drawn per trial."""

    def more(trial):
        return {**suggest(trial), **{k: trial.suggest_float(k, *r) if isinstance(r[0], float) else
                                     trial.suggest_int(k, *r) for k, r in drawn.items()}}  # fmt: skip

    return more


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


def test_where_every_shape_holds_one_trial_the_summary_names_no_parameter_and_numbers_the_shapes():
    """With one trial a shape, every parameter is one value within each shape: a study told apart
    by `hidden` alone said "groups told apart by: hidden, lr, weight_decay", and the size lines
    of shapes labelled alike by the parameters named collapsed into one."""

    def one_shape_each(trial):
        return {**suggest(trial), "hidden": 8 * (trial.number + 1)}

    training = Training(steps=5, batch=TRAINING.batch, loss=F.mse_loss, report_every=5)
    summary = optimize(study(), one_shape_each, build, training, n_trials=3, group_size=2, strategy="vmap",
                       progress=False)  # fmt: skip
    assert summary.shape_params == []
    assert [len(g.trials) for g in summary.groups] == [1, 1, 1]
    assert list(summary.sizes) == ["MLP (shape 1)", "MLP (shape 2)", "MLP (shape 3)"]
    assert "3 shapes, told apart by no one suggested parameter" in str(summary)


def test_a_batch_size_suggested_per_trial_groups_trials_by_it_and_trains_as_the_sequential_loop():
    """A batch size changes no model, but pack stacks the N inputs: trials of different batch
    sizes grouped together failed the whole study at their first step."""

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
        (dict(optimizer="lion"), "unknown optimizer 'lion'.*valid: sgd, adam, adamw, adadelta"),
        (dict(micro_batches=0), "micro_batches=0: give a positive int"),
        (dict(schedule="cosine"), "schedule='cosine' is not callable: give schedule\\(optimizer, params\\)"),
        (dict(cosine=True, schedule=_warm_up_then_cosine), "cosine=True and a schedule: give one"),
        (dict(context=torch.autocast("cpu")), "context=.* is a context manager: give a function that makes one"),
        (dict(clip=-1), "clip=-1"),
        (dict(batch=[torch.zeros(40, 2)] * 3), "^Training: batch is a list, not a function$"),  # (printed whole)
    ],
)
def test_a_training_of_bad_settings_is_refused(kwargs, message):
    with pytest.raises(wt.WideTesseraError, match=message):
        Training(**{**dict(steps=5, batch=TRAINING.batch, loss=F.mse_loss), **kwargs})


def _clock(monkeypatch, loop_s, fused_s, builds=None, measured=STRATEGIES):
    """The probe's clock replaced: each loop step takes `loop_s`, each fused one `fused_s`, each
    build of a group `builds[strategy]` (default: nothing); the switches to `measured` known to
    the dispatch table, as a study before this one measured them (None: the table's own)."""
    from wide_tessera.integrations.optuna import group, probe, sizing
    from wide_tessera.integrations.optuna import study as scheduler

    clock = [0.0]
    monkeypatch.setattr(group, "now", lambda: clock[0])
    monkeypatch.setattr(probe, "now", lambda: clock[0])
    if measured is not None:
        monkeypatch.setattr(sizing, "switch_costs", lambda *_: {s: (builds or {}).get(s, 0.0) for s in measured})
    monkeypatch.setattr(scheduler, "step_seconds", lambda *_: 1.0)  # an estimate the share never reaches
    timed = probe.Probe.timed

    def step(self, s, switch_s=None):
        s = loop_s if self.side == probe.BASELINE else fused_s
        clock[0] += s
        timed(self, s, switch_s)

    monkeypatch.setattr(probe.Probe, "timed", step)
    build = group._Group.__init__

    def built(self, members, plan):
        clock[0] += (builds or {}).get(plan.strategy or "loop", 0.0)
        build(self, members, plan)

    monkeypatch.setattr(group._Group, "__init__", built)


def test_a_shape_the_table_lacks_is_sized_on_its_first_groups_own_steps(tmp_path, monkeypatch):
    """The first group trains in turns (loop, vmap, surgery), every step a step of training, until
    the decision rule settles within the sizing share; it goes on with the winner, writes what it
    learned (a win unconfirmed, confirmed by the next study's agreeing probe), and the trials end
    as they end sequentially. (Measuring the shape by benchmark_custom cost 114 s of a 137 s
    study.) The clock is replaced: fused steps 10x faster than the loop's, switches free."""
    _clock(monkeypatch, loop_s=1e-2, fused_s=1e-3)
    table = tmp_path / "table.json"
    training = Training(steps=40, batch=lambda p, step: (X[step % STEPS], Y[step % STEPS]), loss=F.mse_loss,
                        optimizer="adamw", report_every=10)  # fmt: skip
    sequential = study()
    sequential.optimize(sequential_objective(suggest, build, training), n_trials=4)
    verdicts = []
    for _ in range(2):
        fused = study()
        summary = optimize(fused, suggest, build, training, n_trials=4, table=table, progress=False, sizing_share=1.0)
        (group,) = summary.groups
        assert len(group.trials) == 4 and group.strategy in ("vmap", "surgery") and "3 round(s)" in group.why
        (entry,) = json.loads(table.read_text())["entries"]
        verdicts.append([(v["n"], v["verdict"], v["strategy"]) for v in entry["verdicts"]])
        assert [t.value for t in fused.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-3)
    assert verdicts == [[(4, "unconfirmed", group.strategy)], [(4, "fuse", group.strategy)]]
    # the third study reads the confirmed entry: no probe, fuse() fuses N=4
    summary = optimize(study(), suggest, build, training, n_trials=4, table=table, progress=False)
    assert "probed" not in summary.groups[0].why and summary.groups[0].strategy == group.strategy


def test_a_later_study_predicts_its_switches_by_the_table_and_probes_the_strategy_the_first_left_untried(
    tmp_path, monkeypatch
):  # fmt: skip
    """What a switch into each strategy cost was kept by the process alone: a study in a new
    process (as most studies run) knew none, so it probed the first strategy only and never
    reached surgery. The table keeps them beside the probe's verdict: the next study predicts
    vmap's switch by it and tries surgery's."""
    _clock(monkeypatch, loop_s=1e-2, fused_s=1e-3, builds={"loop": 0.01, "vmap": 0.02, "surgery": 0.03}, measured=None)
    table = tmp_path / "table.json"
    training = Training(steps=40, batch=lambda p, step: (X[step % STEPS], Y[step % STEPS]), loss=F.mse_loss,
                        optimizer="adamw", report_every=10)  # fmt: skip
    whys, kept = [], []
    for _ in range(2):
        summary = optimize(study(), suggest, build, training, n_trials=4, table=table, progress=False, sizing_share=1.0)
        (entry,) = json.loads(table.read_text())["entries"]
        whys.append(summary.groups[0].why)
        kept.append(entry["switch_s"])
    assert ": loop, vmap in turns (surgery untried" in whys[0], whys[0]
    assert ": loop, surgery, vmap in turns, " in whys[1], whys[1]
    assert set(kept[0]) == {"vmap"} and set(kept[1]) == {"vmap", "surgery"}
    assert kept[1]["surgery"] == pytest.approx(0.03, abs=0.01)


def test_where_the_probe_finds_the_loop_faster_the_trials_go_on_one_at_a_time(tmp_path, monkeypatch):
    """No fused strategy wins: the first group's trials go on alone from where the probe left them
    (torch's optimizer state and schedule carried over), end as they end sequentially, and the
    shape's later trials train one at a time; the table says 'loop'."""
    _clock(monkeypatch, loop_s=1e-2, fused_s=2e-2)
    table = tmp_path / "table.json"
    training = Training(steps=40, batch=lambda p, step: (X[step % STEPS], Y[step % STEPS]), loss=F.mse_loss,
                        optimizer="adamw", cosine=True, report_every=10)  # fmt: skip
    sequential = study()
    sequential.optimize(sequential_objective(suggest, build, training), n_trials=6)
    fused = study()
    summary = optimize(fused, suggest, build, training, n_trials=6, table=table, progress=False, sizing_share=1.0)
    assert [len(g.trials) for g in summary.groups] == [4, 1, 1] and "one at a time" in summary.groups[0].why
    assert [t.value for t in fused.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-3)
    (entry,) = json.loads(table.read_text())["entries"]
    assert [v["verdict"] for v in entry["verdicts"]] == ["loop"], summary.groups[0].why


@pytest.mark.parametrize(
    "measured, tried, rounds, stopped",
    [((), "vmap in turns (surgery untried", "2 round(s)", "waiting for a switch to the loop (~0.05 s) to fit"),
     (STRATEGIES, "vmap, surgery in turns, 0 round(s)", "costing 0.05 s", "waiting for a switch to surgery (~0.12 s)")],
)  # fmt: skip
def test_sizing_waits_before_a_unit_that_would_overrun_its_share(measured, tried, rounds, stopped, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """Each unit of the probe (a switch with its build, a step) is taken only where its cost, as
    last measured, fits what is left of the share; a switch nothing measured yet only first; it
    waits on a side that costs nothing beyond the loop. The clock is replaced: a surgery build
    costs 0.12 s, a vmap or loop one 0.05 s, the share 0.16 s at most (a vmap turn, then a
    surgery switch, took a conv study's 3.3 s share to 6.4 s)."""
    from wide_tessera.integrations.optuna import study as study_module

    _clock(monkeypatch, loop_s=1e-2, fused_s=1e-3, builds={"loop": 0.05, "vmap": 0.05, "surgery": 0.12},
           measured=measured)  # fmt: skip
    monkeypatch.setattr(study_module, "step_seconds", lambda member, training, device: 1e-3)  # 0.16 s sequential
    training = Training(steps=40, batch=lambda p, step: (X[step % STEPS], Y[step % STEPS]), loss=F.mse_loss,
                        optimizer="adamw", report_every=10)  # fmt: skip
    summary = optimize(study(), suggest, build, training, n_trials=4, table=tmp_path / "t.json", progress=False,
                       sizing_share=1.0)  # fmt: skip
    why = summary.groups[0].why
    assert tried in why and rounds in why and stopped in why and "of a 0.16 s share" in why, why


def test_with_no_sizing_share_a_shape_the_table_lacks_trains_one_trial_at_a_time(tmp_path):
    table = tmp_path / "table.json"
    training = Training(steps=3, batch=TRAINING.batch, loss=F.mse_loss, report_every=3)
    summary = optimize(study(), suggest, build, training, n_trials=4, table=table, progress=False, sizing_share=0)
    assert [len(g.trials) for g in summary.groups] == [1] * 4 and not table.exists()
    (why,) = summary.sizes.values()
    assert "sizing_share=0" in why
    with pytest.raises(WideTesseraError, match="sizing_share=1.5"):
        optimize(study(), suggest, build, training, n_trials=4, sizing_share=1.5)


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


def test_a_group_size_the_table_knows_nothing_of_is_fused_with_the_strategy_its_probe_names(tmp_path, monkeypatch):
    """group_size=4 alone, an empty table: the first group's probe names the strategy, and both
    groups of 4 run it fused even where the loop was faster (its trials went on one at a time);
    with sizing_share=0 nothing measures, and one line says so before any training."""
    from wide_tessera.dispatch.fuse import DispatchWarning

    _clock(monkeypatch, loop_s=1e-3, fused_s=1e-2)
    training = Training(steps=40, batch=lambda p, step: (X[step % STEPS], Y[step % STEPS]), loss=F.mse_loss,
                        optimizer="adamw", report_every=10)  # fmt: skip
    sequential, fused = study(), study()
    sequential.optimize(sequential_objective(suggest, build, training), n_trials=8)
    summary = optimize(fused, suggest, build, training, n_trials=8, group_size=4, table=tmp_path / "t.json",
                       progress=False, sizing_share=1.0)  # fmt: skip
    assert [len(g.trials) for g in summary.groups] == [4, 4]
    assert summary.groups[0].strategy == summary.groups[1].strategy in STRATEGIES
    assert [t.value for t in fused.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-3)
    with pytest.warns(DispatchWarning, match="group_size=4: the table names no strategy at N=4 and sizing_share=0"):
        summary = optimize(study(), suggest, build, TRAINING, n_trials=4, group_size=4, table=tmp_path / "none.json",
                           progress=False, sizing_share=0)  # fmt: skip
    assert [len(g.trials) for g in summary.groups] == [4]


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

    sequential = study()
    with pytest.raises(ValueError, match="-1.0"):
        sequential.optimize(sequential_objective(negative_lr, build, TRAINING), n_trials=3)
    s = study()
    with pytest.raises(ValueError, match="-1.0"):
        optimize(s, negative_lr, build, TRAINING, n_trials=3, group_size=3, strategy="vmap", progress=False)
    # as sequentially: the trial whose settings torch refuses fails alone (it failed its whole group)
    assert [t.state.name for t in s.trials] == [t.state.name for t in sequential.trials] == ["COMPLETE"] * 2 + ["FAIL"]
    assert [t.value for t in s.trials[:2]] == pytest.approx([t.value for t in sequential.trials[:2]], rel=1e-3)


class _RaisesInTrial(Exception):
    pass


@pytest.mark.parametrize("where", ["batch", "loss", "evaluate"])
def test_a_trial_whose_own_code_raises_fails_alone_and_its_group_trains_on(where):
    """Trial 1's batch, loss or evaluate raises: it fails, its group is repacked without it, its
    mates end as they end sequentially; the error is raised once they are told, or, named in
    `catch`, the study goes on; callbacks see every trial as it ends."""
    probe = study()
    probe.optimize(lambda t: suggest(t)["lr"], n_trials=2)
    second_lr = probe.trials[1].params["lr"]  # the RandomSampler gives trial 1 the same lr in every study

    def batch(params, step):
        if params["lr"] == second_lr and step == 3 and where != "evaluate":
            if where == "batch":
                raise _RaisesInTrial(where)
            return X[step], torch.full_like(Y[step], -7.0)  # the loss refuses it
        return TRAINING.batch(params, step)

    def loss(out, y):
        if bool((y == -7.0).all()):
            raise _RaisesInTrial(where)
        return F.mse_loss(out, y)

    def evaluate(model, params):
        if params["lr"] == second_lr:
            raise _RaisesInTrial(where)
        with torch.no_grad():
            return float(model(X[0]).square().mean())

    training = Training(steps=6, batch=batch, loss=loss, optimizer="adamw", report_every=3,
                        evaluate=evaluate if where == "evaluate" else None)  # fmt: skip
    seen = []
    s = study()
    with pytest.raises(_RaisesInTrial, match=where):
        optimize(s, suggest, build, training, n_trials=3, group_size=3, strategy="vmap", progress=False,
                 callbacks=[lambda st, t: seen.append((t.number, t.state.name))])  # fmt: skip
    assert [t.state.name for t in s.trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert sorted(seen) == [(0, "COMPLETE"), (1, "FAIL"), (2, "COMPLETE")]
    caught = study()
    summary = optimize(caught, suggest, build, training, n_trials=6, group_size=3, strategy="vmap", progress=False,
                       catch=(_RaisesInTrial,), gc_after_trial=True)  # fmt: skip
    assert [t.state.name for t in caught.trials] == ["COMPLETE", "FAIL"] + ["COMPLETE"] * 4
    assert summary.groups[0].failed == [1] and "failed [1]" in str(summary)
    alone = study()
    alone.optimize(sequential_objective(suggest, build, training), n_trials=6, catch=(_RaisesInTrial,))
    got, want = [t.value for t in caught.trials], [t.value for t in alone.trials]
    assert got[:1] + got[2:] == pytest.approx(want[:1] + want[2:], rel=1e-3)


def test_no_trial_is_asked_after_the_timeout():
    s = study()
    optimize(s, suggest, build, TRAINING, n_trials=50, group_size=2, strategy="vmap", progress=False, timeout=1e-9)
    assert len(s.trials) == 0
    with pytest.raises(WideTesseraError, match="timeout=-1"):
        optimize(study(), suggest, build, TRAINING, n_trials=2, timeout=-1)
    with pytest.raises(WideTesseraError, match="catch=.*tuple"):
        optimize(study(), suggest, build, TRAINING, n_trials=2, catch=[ValueError])


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


def _rmse(out, y):  # a loss whose mean over micro-batches is not the batch's
    return F.mse_loss(out, y).sqrt()


# Training as people write it, each fused as the sequential loop trains it: (what is drawn per
# trial, the settings tested, the settings they are tested beside)
TRAINED_AS_WRITTEN = {
    "a warm-up chain, its length per trial": (
        _with(warm_up=(2, 8)), dict(schedule=_warm_up_then_cosine), dict(optimizer="adamw")),
    "wide_tessera.optim's StepLR, its gamma per trial": (
        _with(gamma=(0.3, 0.9)), dict(schedule=lambda o, p: wt.optim.StepLR(o, step_size=4, gamma=p["gamma"])), {}),
    "a LambdaLR": (suggest, dict(schedule=lambda o, p: torch.optim.lr_scheduler.LambdaLR(
        o, lambda step: 1 / (1 + p["lr"] * 100 * step))), dict(optimizer="sgd")),
    "Adadelta, its rho per trial": (_with(rho=(0.5, 0.95)), dict(optimizer="adadelta"), {}),
    "gradient accumulation over 4 micro-batches": (suggest, dict(micro_batches=4), dict(loss=_rmse, clip=0.5)),
    "autocast to bfloat16 on the CPU": (suggest, dict(context=lambda: torch.autocast("cpu", torch.bfloat16)), {}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TRAINED_AS_WRITTEN))
def test_training_as_people_write_it_fuses_as_the_sequential_loop_trains_it(case):
    """Every wide_tessera.optim optimizer and any schedule of one model's (its settings the
    trial's), and a step of the user's own (micro-batches, a context such as autocast): each
    trial's curve and final weights in its group as in the sequential loop (Training took three
    optimizers, a cosine and a fixed step)."""
    drawn, tested, beside = TRAINED_AS_WRITTEN[case]
    weights, rounding = {}, 1e-4

    def kept(model, params):  # the value told: the final weights' sum of squares, the weights kept
        final = torch.cat([p.detach().flatten() for p in model.parameters()])
        weights.setdefault(repr(sorted(params.items())), []).append(final)
        return float(final.square().sum())

    def trained(**settings):
        return Training(**{**dict(steps=12, batch=TRAINING.batch, loss=F.mse_loss, report_every=4, evaluate=kept),
                           **beside, **settings})  # fmt: skip

    without, sequential, fused = study(), study(), study()
    without.optimize(sequential_objective(drawn, build, trained()), n_trials=4)
    sequential.optimize(sequential_objective(drawn, build, trained(**tested)), n_trials=4)
    optimize(fused, drawn, build, trained(**tested), n_trials=4, group_size=4, strategy="surgery", progress=False)
    for a, b in zip(sequential.trials, fused.trials):
        assert a.params == b.params and b.state.name == "COMPLETE"
        assert list(b.intermediate_values.values()) == pytest.approx(list(a.intermediate_values.values()), rel=rounding)
    for untested, alone, grouped in weights.values():
        atol = rounding * float(alone.abs().max())
        torch.testing.assert_close(grouped, alone, rtol=rounding, atol=atol)
        assert (alone - untested).abs().max() > 10 * atol  # what is tested changed the training the paths agree on


def test_a_schedule_is_carried_with_its_trial_when_its_group_is_repacked():
    """A pruned trial leaves its group: each survivor's warm-up chain goes on where it was (a
    scheduler's state, as torch's state_dict has it) and it ends as the sequential loop ends it."""
    training = Training(steps=STEPS, batch=TRAINING.batch, loss=F.mse_loss, optimizer="adamw",
                        schedule=_warm_up_then_cosine, report_every=5)  # fmt: skip
    sequential, pruned = study(), study(_PrunesOddTrialsAtStep(9))
    sequential.optimize(sequential_objective(_with(warm_up=(2, 12)), build, training), n_trials=4)
    summary = optimize(pruned, _with(warm_up=(2, 12)), build, training, n_trials=4, group_size=4, strategy="surgery",
                       progress=False)  # fmt: skip
    assert summary.groups[0].repacked == [2] and summary.groups[0].pruned == [1, 3]
    for a, b in zip(sequential.trials[::2], pruned.trials[::2]):
        assert b.value == pytest.approx(a.value, rel=1e-4)


class _PrunesOddTrialsAtStep(optuna.pruners.BasePruner):
    def __init__(self, step):
        self.step = step

    def prune(self, study, trial):
        return trial.number % 2 == 1 and max(trial.intermediate_values) == self.step


def test_a_schedule_or_a_split_that_cannot_run_fails_its_trial_in_one_line():
    plateau = Training(steps=4, batch=TRAINING.batch, loss=F.mse_loss, report_every=2,
                       schedule=lambda o, p: torch.optim.lr_scheduler.ReduceLROnPlateau(o))  # fmt: skip
    split = Training(steps=4, batch=TRAINING.batch, loss=F.mse_loss, report_every=2, micro_batches=B + 1)
    for training, message in [(plateau, "returned ReduceLROnPlateau: return a learning-rate scheduler"),
                              (split, f"micro_batches={B + 1}: the batch's tensors have \\[{B}\\] rows")]:  # fmt: skip
        with pytest.raises(WideTesseraError, match=message):
            study().optimize(sequential_objective(suggest, build, training), n_trials=1)
        s = study()
        with pytest.raises(WideTesseraError, match=message):
            optimize(s, suggest, build, training, n_trials=2, group_size=2, strategy="vmap", progress=False)
        assert {t.state.name for t in s.trials} == {"FAIL"}  # before any training


def test_trials_run_one_at_a_time_train_exactly_as_the_sequential_loop_trains_them():
    sequential, alone = study(), study()
    sequential.optimize(sequential_objective(suggest, build, TRAINING), n_trials=3)
    summary = optimize(alone, suggest, build, TRAINING, n_trials=3, group_size=1, progress=False)
    assert [t.value for t in alone.trials] == [t.value for t in sequential.trials]  # bit for bit
    assert all(g.why == "one trial: nothing to fuse" and g.strategy is None for g in summary.groups)


_WORKER = """
import sys, pathlib
import optuna, torch
import torch.nn.functional as F
from torch import nn
from wide_tessera.integrations.optuna import Training, optimize

db, marker = sys.argv[1], pathlib.Path(sys.argv[2])
storage = optuna.storages.RDBStorage(db, heartbeat_interval=1, grace_period=2)
study = optuna.load_study(study_name="s", storage=storage)
x = torch.randn(16, 8)

def batch(params, step):
    if step == 2:
        marker.write_text("training")
    return x, x.sum(-1, keepdim=True)

training = Training(steps=10**6, batch=batch, loss=F.mse_loss, report_every=10**6)
optimize(study, lambda t: {"lr": t.suggest_float("lr", 1e-4, 1e-2)}, lambda p: nn.Sequential(nn.Linear(8, 1)), training,
         n_trials=3, group_size=3, strategy="vmap", progress=False)
"""


@pytest.mark.slow
def test_a_killed_workers_trials_fail_as_stale_at_the_next_optimize(tmp_path):
    """On an RDB storage with a heartbeat, a worker killed with SIGKILL in the middle of a group
    leaves its trials RUNNING until the next optimize fails them as stale, as study.optimize's
    killed trial is failed (they were left RUNNING for good: the group recorded no heartbeat)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    db = f"sqlite:///{tmp_path / 'study.db'}"
    storage = optuna.storages.RDBStorage(db, heartbeat_interval=1, grace_period=2)
    optuna.create_study(study_name="s", storage=storage)
    marker = tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, db, str(marker)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the worker never started training"
        time.sleep(1.5)  # a heartbeat or two recorded
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    resumed = optuna.load_study(study_name="s", storage=storage)
    assert [t.state.name for t in resumed.trials] == ["RUNNING"] * 3
    time.sleep(3)  # past the grace period
    training = Training(steps=2, batch=lambda p, step: (X[0], Y[0]), loss=F.mse_loss, report_every=2)
    same_space = lambda t: {"lr": t.suggest_float("lr", 1e-4, 1e-2)}  # noqa: E731  the worker's
    optimize(resumed, same_space, build, training, n_trials=1, group_size=1, progress=False)
    assert [t.state.name for t in resumed.trials] == ["FAIL"] * 3 + ["COMPLETE"]


def _driven(monkeypatch, share=1.0, switches=None):
    """A probe of the first group (16 trials) on a clock of its own, and one step of training on
    it: the side the probe picks runs `cost(side, n)` seconds, after a switch of `switch_s` where
    the side changed. `switches`: what an earlier study measured, by strategy (the table's)."""
    from wide_tessera.integrations.optuna import probe

    clock = [0.0]
    monkeypatch.setattr(probe, "now", lambda: clock[0])
    sizing = probe.Probe.planned(share=share, each_s=0.0, steps=10**6, estimate_s=1e9, switches=switches or {})
    sizing.began(16)
    sizing.switch_s.setdefault(BASELINE, (switches or {}).get(BASELINE, 1e-3))  # the loop's build, as a group's

    def step(cost, switch_s=0.0):
        before = sizing.side
        side = sizing.begin_step()
        switched = switch_s if side != before else None
        seconds = cost(side, sizing.n)
        clock[0] += seconds + (switched or 0.0)
        sizing.timed(seconds, switched)

    return sizing, step


def test_a_sides_step_after_its_first_switch_is_predicted_by_the_step_the_switch_took(monkeypatch):
    """Before any plain step of a side was timed, its next step is predicted to cost what the
    step after the switch cost beyond the loop's, not nothing: a probe took a surgery step it had
    no room for."""
    sizing, step = _driven(monkeypatch)
    for _ in range(TURN_STEPS):
        step(lambda side, n: 0.01)
    step(lambda side, n: 0.04, switch_s=0.2)
    unit, predicted = sizing.next_unit()
    assert unit == f"a step of {sizing.strategies[0]}" and predicted == pytest.approx(0.03)


def test_a_probe_whose_group_shrinks_compares_steps_of_one_size_only(monkeypatch):
    """Trials pruned while the first group probes repack it smaller: a loop turn timed at N=16
    against a fused turn at 15 made a fused side that is no faster look 7% faster, and settle
    'fuse'. Here every step costs the same per trial on both sides, and the group loses one
    trial a turn: the rounds begin again at each size, so nothing settles."""
    sizing, step = _driven(monkeypatch)
    for _ in range(6 * TURN_STEPS):
        step(lambda side, n: n * 1e-2, switch_s=1e-3)
        if sizing.turn_steps == TURN_STEPS:
            sizing.resized(sizing.n - 1)
    assert not sizing.fuses and sizing.final().kind == "open" and sizing.n == 10
    assert "at N=10 (of 16, the others pruned)" in sizing.said()


def test_probing_costs_at_most_its_share_of_the_study_so_far_waiting_on_a_side_that_costs_nothing(monkeypatch):
    """A share of the study's estimated sequential time let a pruned study (3 s sequential) spend
    18-32% of its fused time sizing: the share is now of the study's time so far. With switches of
    50 ms and loop steps of 10 ms, a 10% share waits on the loop until the study has run 0.5 s
    before its first switch, and on vmap (faster than the loop) before each switch back; it never
    costs more than its share, and settles in the end."""
    sizing, step = _driven(monkeypatch, share=0.1, switches={"vmap": 0.05, "surgery": 1e9, BASELINE: 0.05})
    sides = []
    for _ in range(600):
        step(lambda side, n: 0.01 if side == BASELINE else 0.004, switch_s=0.05)
        sides.append(sizing.side)
        assert sizing.cost_s <= sizing.budget_s + 1e-9
        if sizing.done:
            break
    assert sides.index("vmap") >= 50 and sizing.final().kind == "fuse" and sizing.winner() == "vmap", sizing.said()


def test_trials_train_alone_while_the_pruner_waits_for_finished_ones_and_a_lone_trial_probes_nothing(tmp_path):
    """A median pruner judges a trial once n_startup_trials have finished: until then the study's
    trials train one at a time, as sequentially (a first group of 16 pruned none of its trials);
    a group size of the caller's is kept. A trial left alone at the end times nothing: its
    probe wrote the table an entry at N=0."""
    table = tmp_path / "t.json"
    training = Training(steps=4, batch=TRAINING.batch, loss=F.mse_loss, report_every=2)
    summary = optimize(study(optuna.pruners.MedianPruner(n_startup_trials=2)), suggest, build, training, n_trials=3,
                       table=table, progress=False)  # fmt: skip
    assert [len(g.trials) for g in summary.groups] == [1, 1, 1]
    assert "alone: the MedianPruner judges a trial once 2 have finished" in summary.groups[0].why
    assert not table.exists() or all(
        v["n"] >= 2 for e in json.loads(table.read_text())["entries"] for v in e["verdicts"]
    )
    summary = optimize(study(optuna.pruners.MedianPruner(n_startup_trials=2)), suggest, build, training, n_trials=4,
                       group_size=2, strategy="vmap", progress=False)  # fmt: skip
    assert [len(g.trials) for g in summary.groups] == [2, 2]
