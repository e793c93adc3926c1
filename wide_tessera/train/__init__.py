"""Training N models: the one training step the train mode's measurement, the Optuna integration
and the tests run, wide or separate, with the pairing of torch's optimizers and ours; each model's
own scheduler over one optimizer of N; and the memory one of N models needs."""

from .memory import bytes_per_model
from .schedules import EachModel
from .step import OPTIMIZERS, Schedule, Step, separate_step, wide_step

__all__ = ["OPTIMIZERS", "EachModel", "Schedule", "Step", "bytes_per_model", "separate_step", "wide_step"]
