"""Optuna studies whose trials train fused: each group of trials whose models share a shape trains
as one wide model (`fuse()` and `wide_tessera.optim`), each trial with its own settings, its
intermediate values reported to Optuna and pruned one by one.

    import optuna
    from wide_tessera.integrations.optuna import Training, optimize

    def suggest(trial):
        return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
                "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1)}

    training = Training(steps=200, batch=lambda params, step: data[step], loss=F.mse_loss, optimizer="adamw")
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
    summary = optimize(study, suggest, lambda params: MLP(), training, n_trials=16)
    print(summary)

A hyperparameter sweep of a small model leaves a machine idle one trial at a time; its trials
differ in numbers (learning rate, weight decay, betas, seed) that change no shape. HFTA (MLSys'21)
trained such trials as one fused model with its own driver; this runs them under the study you
already have, through Optuna's ask-and-tell, so its storage, dashboard and trials_dataframe()
work as usual.

* **Groups.** Trials are asked one at a time; a trial joins the trials waiting whose models have
  its shape (every parameter's and buffer's name, shape and dtype, and every setting a module
  keeps but a rate: a dropout's p, a LeakyReLU's slope and a LoRA layer's alpha (ours or PEFT's) run per trial
  within a group, widen.rates). A group trains when it has `group_size` trials (or when no trial is left to ask).
  The summary says which suggested parameters told groups apart.
* **Group size.** The user's number, or the measurement's: the largest N at which this
  machine's dispatch table says the model's training step fuses (`--mode train` entries: a
  `tune` run's, or a probe's: where the table decides nothing, the first group's own steps run
  as the loop and fused in turns within `sizing_share` of the study's time, probe.Probe, and
  what they decide is written to the table), capped by memory. The summary says which size
  and why.
* **Pruning.** A trial Optuna's pruner stops is frozen at once (`opt.freeze`); the group is then
  repacked without it (its survivors' weights, optimizer states and schedule carried over
  exactly), so a pruned trial stops costing time.
* **Same answer.** Each trial's model is built under `torch.manual_seed(params.get('seed',
  trial.number))`, and `sequential_objective` trains one trial alone with torch's own optimizer,
  clipping and schedule: the baseline a fused study is compared with, per step.
"""

from .sequential import sequential_objective
from .study import optimize
from .summary import GroupRecord, StudySummary
from .training import Training
from .trial import trial_seed

__all__ = ["Training", "optimize", "sequential_objective", "StudySummary", "GroupRecord", "trial_seed"]
