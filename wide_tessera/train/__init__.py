"""Training N models: the one training step the train mode's measurement, the Optuna integration
and the tests run, wide or separate, with the pairing of torch's optimizers and ours; and the memory
one of N models needs."""

from .memory import bytes_per_model
from .step import OPTIMIZERS, Step, separate_step, wide_step

__all__ = ["OPTIMIZERS", "Step", "bytes_per_model", "separate_step", "wide_step"]
