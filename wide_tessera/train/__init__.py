"""Training N models: the one training step the train mode's measurement, the Optuna integration
and the tests run, wide or separate, with the pairing of torch's optimizers and ours."""

from .step import OPTIMIZERS, Step, separate_step, wide_step

__all__ = ["OPTIMIZERS", "Step", "separate_step", "wide_step"]
