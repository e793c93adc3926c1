"""The memory one of N models needs while N of them run or train, estimated from one model and one
input before the N are built: what a point is checked against the memory budget with, and what
caps the Optuna integration's group size."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..core import trees

__all__ = ["STATE_PER_WEIGHT", "bytes_per_model"]

# the tensors each of our optimizers (and torch's) keeps per weight: SGD's momentum buffer, Adam's
# and AdamW's two moments, Adadelta's two running averages
STATE_PER_WEIGHT = {"sgd": 1, "adam": 2, "adamw": 2, "adadelta": 2}


def bytes_per_model(model: nn.Module, inputs: Any, outputs: Any, optimizer: Optional[str]) -> int:
    """The bytes one model adds to a run of N of it, from one model (its parameters and buffers, a
    tied tensor once) and one input and its output.

    Two sides are held: the N models as given and their wide copy (a point checks and times both;
    the Optuna integration keeps its trials' models beside the group's fused one, and its probe
    times both). Each side holds the weights and an input and output. Trained (`optimizer`, the
    optimizer's name; None: run only), each side also holds the weights' gradients and the
    optimizer's state (STATE_PER_WEIGHT), and a gradient of each input and output (where an input
    is data and needs none, the N separate draws held beside the packed batch take its room). The
    activations a backward keeps are not counted: they are the model's, as many for N models fused
    as for N apart.
    """
    held = {id(t): t for t in (*model.parameters(), *model.buffers())}
    weights = sum(t.numel() * t.element_size() for t in held.values())
    io = sum(t.numel() * t.element_size() for t in trees.tensors([inputs, outputs]))
    if optimizer is None:
        return 2 * (weights + io)
    return 2 * ((2 + STATE_PER_WEIGHT[optimizer]) * weights + 2 * io)
