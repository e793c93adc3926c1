"""Per-model rates: a number a layer keeps that changes no shape (a dropout's p, a LeakyReLU's
slope, a LoRA layer's scaling), held as a buffer of each model so that N models differing only
in it run as one.

A hyperparameter sweep draws a dropout rate per trial; kept as a plain setting, every rate was
a configuration of its own (`ops.alike.layout_of`), so trials differing in it never fused: 8
trials with a float rate each ran alone, 103 s against 17 s sequential; a LoRA sweep's alpha
(`ops.lora.LoRALinear` keeps alpha / rank as a float) made each of 8 trials a group of one.
`with_own_rates` gives copies of the models with each such layer swapped for one that reads its
number from a buffer (0-dimensional, not saved: the state_dicts are the models' own), which
vmap and surgery stack like any buffer, so model i computes with its own number, and the loop
runs each copy.

What stays a configuration, and why: a norm's eps is an argument of torch's native norm kernels
(F.layer_norm, F.batch_norm take one float) and of the wide norm layers surgery swaps in, so a
per-model eps would write the norm out of primitives and lose the kernel; a loss's label
smoothing belongs to the loss, which the caller computes for each model (the Optuna
integration's `Training.loss`), not to a module.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Sequence, Tuple, Type

import torch
from torch import nn

from ..ops.alike import layout_of
from ..ops.lora import LoRALinear

__all__ = ["RateDropout", "RateLeakyReLU", "RATE_LAYERS", "rate_settings", "rates_differ_alone", "with_own_rates"]


class RateDropout(nn.Module):
    """nn.Dropout whose p is the buffer `rate`: in training, each element kept where a uniform draw
    is below 1 - rate and scaled by 1 / (1 - rate); a rate of 1 gives zeros, as nn.Dropout's does.
    The mask is torch.bernoulli's of a tensor of probabilities (a uniform below the probability,
    the same bits on the CPU); nn.Dropout's own kernel draws its mask otherwise, so the two agree
    in law, not draw for draw."""

    rate: torch.Tensor

    def __init__(self, p: float, inplace: bool = False):
        super().__init__()
        self.inplace = inplace
        self.register_buffer("rate", torch.tensor(float(p)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = 1 - self.rate.to(x.dtype)
        scale = torch.where(keep > 0, 1 / keep, torch.zeros_like(keep))
        out = x * (torch.rand_like(x) < keep) * scale
        return x.copy_(out) if self.inplace else out


class RateLeakyReLU(nn.Module):
    """nn.LeakyReLU whose negative slope is the buffer `slope`: x where x > 0, else x * slope
    (torch's own product, so the same bits; at exactly 0 the gradient is the slope's, as torch's:
    with `>=` a zero bias on zero-padded rows stepped 0.97 off the separate models)."""

    slope: torch.Tensor

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False):
        super().__init__()
        self.inplace = inplace
        self.register_buffer("slope", torch.tensor(float(negative_slope)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.where(x > 0, x, x * self.slope.to(x.dtype))
        return x.copy_(out) if self.inplace else out


def _scaling_held(layer: LoRALinear) -> LoRALinear:
    """The LoRA layer with its scaling (alpha / rank) a buffer: its forward multiplies by it as by
    the float (a 0-dimensional float32 tensor: the same product in float32, and no promotion of
    a bfloat16 output)."""
    scaling = float(layer.scaling)
    del layer.scaling
    layer.register_buffer("scaling", torch.tensor(scaling), persistent=False)
    return layer


# a layer class (exactly: a subclass may read its number otherwise), the setting that is its
# rate, and the layer that reads it from a buffer, built from the layer (a copy: it may be changed)
RATE_LAYERS: Dict[Type[nn.Module], Tuple[str, Callable[[Any], nn.Module]]] = {
    nn.Dropout: ("p", lambda m: RateDropout(m.p, m.inplace)),
    nn.LeakyReLU: ("negative_slope", lambda m: RateLeakyReLU(m.negative_slope, m.inplace)),
    LoRALinear: ("scaling", _scaling_held),
}


def rate_settings(module: nn.Module) -> List[str]:
    """The names, as `ops.alike.layout_of` gives them, of the settings in `module` that are rates."""
    return [
        f"{path}.{RATE_LAYERS[type(m)][0]}" if path else RATE_LAYERS[type(m)][0]
        for path, m in module.named_modules()
        if type(m) in RATE_LAYERS
    ]


def rates_differ_alone(modules: Sequence[nn.Module]) -> bool:
    """Whether the modules are one configuration but for their rates (`ops.alike.layout_of` of each,
    its rates left out, alike)."""

    def shared(module: nn.Module) -> Dict[str, Any]:
        rates = set(rate_settings(module))
        return {k: v for k, v in layout_of(module).items() if k not in rates}

    first = shared(modules[0])
    return all(shared(m) == first for m in modules[1:])


def with_own_rates(modules: Sequence[nn.Module]) -> List[nn.Module]:
    """Copies of `modules`, every rate layer swapped for its buffer form: models that differed only
    in their rates are then one configuration, each model's rate in its buffer. Each copy shares
    its model's frozen parameters (a LoRA base): fuse() holds a base all N models hold once, the
    models' own, and N deep copies of it cost N times its memory before that."""
    return [_swapped(copy.deepcopy(m, _frozen(m))).to(_device(m)) for m in modules]


def _frozen(module: nn.Module) -> Dict[int, Any]:
    """A deepcopy memo that keeps the module's frozen parameters as they are, not copied."""
    return {id(p): p for p in module.parameters() if not p.requires_grad}


def _device(module: nn.Module) -> torch.device:
    """Where the module's tensors are (the buffers made here go there too)."""
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    return first.device if first is not None else torch.device("cpu")


def _swapped(module: nn.Module) -> nn.Module:
    if type(module) in RATE_LAYERS:  # then its children: a LoRA layer's dropout is a rate too
        module = RATE_LAYERS[type(module)][1](module).train(module.training)
    for name, child in list(module.named_children()):
        setattr(module, name, _swapped(child))
    return module
