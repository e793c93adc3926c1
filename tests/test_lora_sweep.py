"""A LoRA sweep: an Optuna study of learning rate, alpha and dropout over one frozen base trains
its trials in one fused group, the base held once, each trial as it trains alone."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_tessera.integrations.optuna.group as group
from wide_tessera.ops.lora import LoRALinear

optuna = pytest.importorskip("optuna")
from wide_tessera.integrations.optuna import Training, optimize, sequential_objective  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
D, RANK, B, STEPS = 16, 4, 8, 12

torch.manual_seed(0)
BASE = nn.Linear(D, D).requires_grad_(False)  # one base for every trial, as one checkpoint is
X = torch.randn(STEPS, B, D, generator=torch.Generator().manual_seed(1))
Y = X.flip(-1).sin()
TRAINING = Training(steps=STEPS, batch=lambda params, step: (X[step], Y[step]), loss=F.mse_loss, optimizer="adamw",
                    report_every=4)  # fmt: skip


def build(params):
    return LoRALinear(BASE, RANK, params["alpha"], params["dropout"])


def sweep(dropout):
    def suggest(trial):
        return {
            "lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
            "alpha": trial.suggest_float("alpha", 1.0, 32.0),
            "dropout": trial.suggest_float("dropout", *dropout),
        }

    return suggest


def study():
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.NopPruner())


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_a_lora_sweep_trains_in_one_group_over_one_base_as_each_trial_alone(strategy, monkeypatch):
    """Alpha was a float each LoRA layer kept (scaling = alpha / rank), so every trial was a
    configuration of its own: 4 trials, 4 groups of one. It is a rate now (widen.rates), held as a
    buffer per trial like a dropout's p, and the frozen base all trials hold is held once, the
    trials' own. With dropout, a group draws its masks at once, not as each trial does alone
    (docs/sweeps.md), so the values are compared without it."""
    fused, fuse = [], group.fuse
    monkeypatch.setattr(group, "fuse", lambda *a, **k: fused.append(fuse(*a, **k)) or fused[-1])
    dropped = study()
    summary = optimize(dropped, sweep((0.0, 0.5)), build, TRAINING, n_trials=4, group_size=4, strategy=strategy,
                       progress=False)  # fmt: skip
    assert [(len(g.trials), g.strategy) for g in summary.groups] == [(4, strategy)]
    assert len({t.params["alpha"] for t in dropped.trials}) == len({t.params["dropout"] for t in dropped.trials}) == 4
    bases = [t for t in fused[0].state_dict().values() if t.shape[-2:] == (D, D)]
    assert [(tuple(t.shape), t.data_ptr()) for t in bases] == [((D, D), BASE.weight.data_ptr())]

    sequential, together = study(), study()
    sequential.optimize(sequential_objective(sweep((0.0, 0.0)), build, TRAINING), n_trials=4)
    summary = optimize(together, sweep((0.0, 0.0)), build, TRAINING, n_trials=4, group_size=4, strategy=strategy,
                       progress=False)  # fmt: skip
    assert [len(g.trials) for g in summary.groups] == [4]
    assert [t.value for t in together.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-5)
    assert BASE.weight.grad is None


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_a_sweep_of_peft_wrapped_trials_trains_in_one_group_as_each_trial_alone(strategy):
    """A trial's model built with PEFT (get_peft_model over one frozen base) keeps alpha in PEFT's
    dicts: each alpha was a configuration of its own, 4 trials in 4 groups of one. They share a
    group now, and each trial's value is the one it reaches alone."""
    peft = pytest.importorskip("peft")
    base = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)).requires_grad_(False)

    def build_peft(params):
        config = peft.LoraConfig(r=RANK, lora_alpha=params["alpha"], target_modules=["0", "2"])
        return peft.get_peft_model(copy.deepcopy(base), config)

    sequential, together = study(), study()
    sequential.optimize(sequential_objective(sweep((0.0, 0.0)), build_peft, TRAINING), n_trials=4)
    summary = optimize(together, sweep((0.0, 0.0)), build_peft, TRAINING, n_trials=4, group_size=4,
                       strategy=strategy, progress=False)  # fmt: skip
    assert [(len(g.trials), g.strategy) for g in summary.groups] == [(4, strategy)]
    assert len({t.params["alpha"] for t in together.trials}) == 4
    assert [t.value for t in together.trials] == pytest.approx([t.value for t in sequential.trials], rel=1e-5)
