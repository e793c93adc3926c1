"""Per-model rates: a number a layer keeps that changes no shape (a dropout's p, a LeakyReLU's
slope, a LoRA layer's scaling, ours or PEFT's), held as a buffer of each model so that N models
differing only in it run as one.

A hyperparameter sweep draws a dropout rate per trial; kept as a plain setting, every rate was
a configuration of its own (`ops.alike.layout_of`), so trials differing in it never fused: 8
trials with a float rate each ran alone, 103 s against 17 s sequential; a LoRA sweep's alpha
(`ops.lora.LoRALinear` keeps alpha / rank as a float) made each of 8 trials a group of one, and
so did a study of PEFT-wrapped models (PEFT's LoRA layers keep `lora_alpha` and `scaling` as
dicts of floats, by adapter name).
`with_own_rates` gives copies of the models with each such layer swapped for one that reads its
number from a buffer (0-dimensional, not saved: the state_dicts are the models' own), which
vmap and surgery stack like any buffer, so model i computes with its own number; the loop runs
the models themselves (a copy shares their tensors, and training it would train them).

What stays a configuration, and why: a norm's eps is an argument of torch's native norm kernels
(F.layer_norm, F.batch_norm take one float) and of the wide norm layers surgery swaps in, so a
per-model eps would write the norm out of primitives and lose the kernel; a loss's label
smoothing belongs to the loss, which the caller computes for each model (the Optuna
integration's `Training.loss`), not to a module.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import torch
from torch import nn

from ..ops.alike import class_setting, layout_of
from ..ops.exact import times
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
        self.register_buffer("rate", torch.tensor(float(p), dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = 1 - self.rate.to(x.dtype)
        scale = torch.where(keep > 0, 1 / keep, torch.zeros_like(keep))
        out = x * (torch.rand_like(x) < keep) * scale
        return x.copy_(out) if self.inplace else out


class RateLeakyReLU(nn.Module):
    """nn.LeakyReLU whose negative slope is the buffer `slope`: x where x > 0, else x * slope
    (rounded as torch rounds x times the float: ops.exact.times, so the same bits; at exactly 0
    the gradient is the slope's, as torch's: with `>=` a zero bias on zero-padded rows stepped
    0.97 off the separate models)."""

    slope: torch.Tensor

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False):
        super().__init__()
        self.inplace = inplace
        self.register_buffer("slope", torch.tensor(float(negative_slope), dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.where(x > 0, x, times(x, self.slope))
        return x.copy_(out) if self.inplace else out


def _scaling_held(layer: LoRALinear) -> LoRALinear:
    """The LoRA layer with its scaling (alpha / rank) a float64 buffer, which its forward
    multiplies by as by the float (ops.exact.times)."""
    scaling = float(layer.scaling)
    del layer.scaling
    held = torch.tensor(scaling, dtype=torch.float64, device=_device(layer))
    layer.register_buffer("scaling", held, persistent=False)
    return layer


class _HeldRates(MutableMapping[str, torch.Tensor]):
    """A PEFT LoRA layer's dict of numbers by adapter name (`scaling`, `lora_alpha`), each number
    a 0-dimensional float64 buffer of the layer read at lookup: vmap and surgery swap the layer's
    buffers for the stacked ones, and a lookup reads model i's (through getattr, as torch.fx's
    tracer sees a buffer read; a tensor read past it was kept as a constant of model 0's). Not a
    dict, so `ops.alike.layout_of` does not compare it: models differing in it are alike."""

    def __init__(self, layer: nn.Module, prefix: str, numbers: Dict[str, Any]):
        self._layer, self._prefix = layer, prefix
        for adapter, number in numbers.items():
            self[adapter] = number

    def _name(self, adapter: str) -> str:
        return f"{self._prefix}_{adapter}"

    def __getitem__(self, adapter: str) -> torch.Tensor:
        if self._name(adapter) not in self._layer._buffers:
            raise KeyError(adapter)
        held: torch.Tensor = getattr(self._layer, self._name(adapter))
        return held

    def __setitem__(self, adapter: str, number: Any) -> None:
        held = torch.as_tensor(number, dtype=torch.float64, device=_device(self._layer))
        self._layer.register_buffer(self._name(adapter), held.detach().clone(), persistent=False)

    def __delitem__(self, adapter: str) -> None:
        del self._layer._buffers[self._name(adapter)]

    def __iter__(self) -> Iterator[str]:
        start = f"{self._prefix}_"
        return (name[len(start) :] for name in list(self._layer._buffers) if name.startswith(start))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _peft_scaling_held(layer: nn.Module) -> nn.Module:
    """The PEFT LoRA layer with `scaling` and `lora_alpha` held as buffers (_HeldRates): its
    forward multiplies by `self.scaling[adapter]`, a float64 0-dimensional tensor where it was
    the float, and `set_scale` writes there as it did. That product is PEFT's code, in the
    output's dtype: the same bits as the float's in float32 and float64; in a half precision
    (a bfloat16 model, or autocast) the number is rounded to it first, where PEFT alone
    multiplies in float32 (a relative 2**-9 of the adapter's output in bfloat16)."""
    for setting in _PEFT_RATES:
        setattr(layer, setting, _HeldRates(layer, f"rate_{setting}", dict(getattr(layer, setting))))
    return layer


# a layer class (exactly: a subclass may read its number otherwise), the settings that are its
# rates, and the layer that reads them from buffers, built from the layer (a copy: it may be changed)
RATE_LAYERS: Dict[Type[nn.Module], Tuple[Tuple[str, ...], Callable[[Any], nn.Module]]] = {
    nn.Dropout: (("p",), lambda m: RateDropout(m.p, m.inplace)),
    nn.LeakyReLU: (("negative_slope",), lambda m: RateLeakyReLU(m.negative_slope, m.inplace)),
    LoRALinear: (("scaling",), _scaling_held),
}
# PEFT's LoRA layers whose forward multiplies the adapter's output by `self.scaling[adapter]`,
# read by name only once PEFT is imported (a model built with it has imported it)
_PEFT_LAYERS = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d")
_PEFT_RATES = ("scaling", "lora_alpha")


def _rates_of(module: nn.Module) -> Optional[Tuple[Tuple[str, ...], Callable[[Any], nn.Module]]]:
    """The rates `module` keeps and how to hold them (RATE_LAYERS), or None."""
    if type(module) in RATE_LAYERS:
        return RATE_LAYERS[type(module)]
    return (_PEFT_RATES, _peft_scaling_held) if _is_peft_lora(module) else None


def _is_peft_lora(module: nn.Module) -> bool:
    """Whether `module` is one of PEFT's LoRA layers that scale by `self.scaling[adapter]`."""
    peft_lora = sys.modules.get("peft.tuners.lora.layer")
    return (
        peft_lora is not None
        and type(module).__module__ == peft_lora.__name__
        and type(module).__name__ in _PEFT_LAYERS
        and isinstance(getattr(module, "scaling", None), dict)
    )


def rate_settings(module: nn.Module) -> List[str]:
    """The names, as `ops.alike.layout_of` gives them, of the settings in `module` that are rates;
    a PEFT adapter's dropout is one whether it is an nn.Dropout or, at a rate of 0, PEFT's
    nn.Identity (its class and settings: _dropouts_of)."""
    return [
        *(
            f"{path}.{setting}" if path else setting
            for path, m in module.named_modules()
            for setting in (_rates_of(m) or ((), None))[0]
        ),
        *(name for path in _dropouts_of(module) for name in (class_setting(path), f"{path}.inplace")),
    ]


def _dropouts_of(module: nn.Module) -> List[str]:
    """The paths of the PEFT adapters' dropouts in `module` (`lora_dropout[adapter]`)."""
    return [
        f"{path}.lora_dropout.{adapter}" if path else f"lora_dropout.{adapter}"
        for path, m in module.named_modules()
        if _is_peft_lora(m)
        for adapter in m.lora_dropout
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
    in their rates are then one configuration, each model's rate in its buffer. A copy is new only
    along the way to its rate layers, and holds its model's tensors and its other submodules as
    they are: vmap and surgery stack them into tensors of their own (a LoRA base all N models
    hold, they hold once), and a deep copy of 16 PEFT models made 58% of fuse()'s 0.40 s (cProfile,
    one thread), paid at each switch of an Optuna probe. A PEFT adapter's dropout that is an
    nn.Identity (PEFT's for a rate of 0) where another model's is an nn.Dropout becomes a dropout
    of rate 0 (one that draws: all N run one code), and stays as it is where every model's is (a
    model that draws nothing must not need `randomness`)."""
    dropping = {path for m in modules for path in _dropouts_of(m) if type(m.get_submodule(path)) is nn.Dropout}
    return [_swapped(m, "", dropping, _device(m)) for m in modules]


def _device(module: nn.Module) -> torch.device:
    """Where the module's tensors are (the buffers made here go there too)."""
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    return first.device if first is not None else torch.device("cpu")


def _swapped(module: nn.Module, path: str, dropping: Set[str], device: torch.device) -> nn.Module:
    """`module` (at `path`) with its rate layers in their buffer form, and an nn.Identity at a path of
    `dropping` a dropout of rate 0: a new module where anything in it changes, else `module`."""
    if path in dropping and type(module) is nn.Identity:
        return RateDropout(0.0).to(device).train(module.training)
    given = dict(module.named_children())
    children = {name: _swapped(c, f"{path}.{name}" if path else name, dropping, device) for name, c in given.items()}
    rates = _rates_of(module)
    if rates is None and all(children[name] is c for name, c in given.items()):
        return module
    made = copy.copy(module)  # its own dicts of tensors and submodules, the tensors themselves shared
    made._parameters, made._buffers = dict(module._parameters), dict(module._buffers)
    made._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    made._modules = {**module._modules, **children}
    if rates is None:
        return made
    held = rates[1](made)  # the copy changed in place, or a new layer of the copy's settings
    return (held if held is made else held.to(device)).train(module.training)
