"""A PEFT model's N LoRA adapters as one model to train: the base read once for the N batches.

PEFT trains one adapter at a time; N adapters of one base (N fine-tunes, or one fine-tune's
learning rates) trained apart run the base N times and hold N copies of it. `fuse_adapters`
gives one module whose forward takes the N adapters' batches stacked ([N, batch, ...]) and runs
each adapter on its own batch in one pass: every PEFT LoRA Linear becomes the `lora` op's wide
module (ops.lora.WideLoRA: the base layer once, the N adapters' A and B stacked, each adapter's
scaling and dropout its own), over a copy of the model that shares every frozen tensor with it.

    fused = fuse_adapters(peft_model)                        # every LoRA adapter the model has
    optimizer = wide_tessera.optim.AdamW(fused, lr=[1e-3, 3e-4, 1e-4])
    logits = fused(input_ids=ids).logits                     # ids [N, batch, seq] -> [N, batch, seq, vocab]
    sum(loss(logits[i], labels[i]) for i in range(N)).backward(); optimizer.step()
    fused.unfuse(into=peft_model)                            # then peft_model.save_pretrained(...)

Train on the sum of each adapter's own loss, from its `logits[i]`: a loss the model computes from
`labels=` is the mean over all N batches' tokens, which gives each adapter 1/N of its gradient.
Adapters of different ranks, target modules or kinds are refused in one line: fuse each group
of alike adapters on its own.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..core import trees
from ..core.errors import MissingDependency, WideTesseraError
from ..core.layout import Slot, prefixed, slots_of
from ..ops.lora import PEFT_MISSING, WideLoRA

__all__ = ["fuse_adapters", "FusedAdapters"]


class FusedAdapters(nn.Module):
    """N LoRA adapters of one PeftModel as one module (see the module's docstring).

    `model` is the adapted transformers model with each LoRA layer a WideLoRA; `adapters` the N
    adapters' names, in the order of the stacked batches.
    """

    def __init__(self, model: nn.Module, adapters: Sequence[str], layers: Dict[str, WideLoRA]):
        super().__init__()
        self.model, self.adapters, self.n = model, list(adapters), len(adapters)
        self._layers = list(layers)  # their paths in `model`, as in the PEFT model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Every tensor argument [N, batch, ...] -> the model's output with every tensor [N, batch, ...]."""
        leaves, structure = trees.flat((args, kwargs))
        for t in leaves:
            if t.dim() < 2 or t.shape[0] != self.n:
                raise WideTesseraError(
                    f"an input of shape {list(t.shape)}: give each argument as the {self.n} adapters' batches "
                    f"stacked, [{self.n}, batch, ...]"
                )
        rows = self.n * leaves[0].shape[1] if leaves else None
        args, kwargs = trees.unflat([t.flatten(0, 1) for t in leaves], structure)
        output = self.model(*args, **kwargs)
        for key, value in output.items() if hasattr(output, "items") else ():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
                output[key] = value.unflatten(0, (self.n, -1))
        return output

    def model_slots(self) -> Dict[str, Slot]:
        """Each LoRA layer's adapters stacked and its base shared, named as in one adapter's model."""
        slots: Dict[str, Slot] = {}
        for path in self._layers:
            slots.update(prefixed(slots_of(self.model.get_submodule(path)), f"model.{path}", path))
        return slots

    @torch.no_grad()
    def unfuse(self, into: nn.Module) -> nn.Module:
        """Write each adapter's weights into `into` (the PeftModel fused, or one like it), as PEFT
        holds them, so that its `save_pretrained` saves what trained; returns `into`."""
        model = _adapted(into)
        for path in self._layers:
            wide = self.model.get_submodule(path)
            layer = model.get_submodule(path)
            for i, name in enumerate(self.adapters):
                if name not in layer.lora_A:
                    raise WideTesseraError(f"unfuse: {path} of the model given has no adapter {name!r}")
                layer.lora_A[name].weight.copy_(wide.lora_A[i])
                layer.lora_B[name].weight.copy_(wide.lora_B[i])
        return into


def fuse_adapters(peft_model: nn.Module, adapters: Optional[Sequence[str]] = None) -> FusedAdapters:
    """The PeftModel's LoRA `adapters` (default: all it has) as one module; see the module's docstring.
    `peft_model` is left as it was; its frozen tensors are shared, not copied."""
    try:
        from peft.tuners.lora import Linear as LoRALinear
        from peft.tuners.lora import LoraLayer
    except ImportError:
        raise MissingDependency(f"fuse_adapters {PEFT_MISSING}") from None
    model = _adapted(peft_model)
    configs = peft_model.peft_config
    names = list(configs) if adapters is None else list(adapters)
    _check_configs(configs, names)
    lora = {path: m for path, m in model.named_modules() if isinstance(m, LoraLayer)}
    for path, layer in lora.items():
        if type(layer) is not LoRALinear:
            raise WideTesseraError(f"{path} is a PEFT {type(layer).__name__}: only LoRA on nn.Linear layers fuses")
        _check_layer(path, layer, names)
    # a copy that shares every frozen tensor (the base) and copies the adapters
    memo: Dict[int, Any] = {id(p): p for p in model.parameters() if not p.requires_grad}
    memo.update({id(b): b for b in model.buffers()})
    copied = copy.deepcopy(model, memo)
    layers = {path: _wide(layer, names) for path, layer in lora.items()}
    for path, wide in layers.items():
        copied.set_submodule(path, wide)
    for p in copied.parameters():
        p.requires_grad_(False)
    for wide in layers.values():
        wide.lora_A.requires_grad_(True)
        wide.lora_B.requires_grad_(True)
    return FusedAdapters(copied, names, layers).train(peft_model.training)


def _adapted(peft_model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel, its LoRA layers in place."""
    tuner = getattr(peft_model, "base_model", None)
    model = getattr(tuner, "model", None)
    if not hasattr(peft_model, "peft_config") or not isinstance(model, nn.Module):
        raise WideTesseraError(f"a {type(peft_model).__name__}: give a peft PeftModel (get_peft_model's)")
    return model


def _check_configs(configs: Dict[str, Any], names: List[str]) -> None:
    """One line for adapters that cannot run as one: unknown, not LoRA, or unlike the first."""
    if not names:
        raise WideTesseraError("fuse_adapters: give at least one adapter name")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise WideTesseraError(f"adapter {twice[0]!r} is named twice: give each adapter once")
    unknown = [n for n in names if n not in configs]
    if unknown:
        raise WideTesseraError(f"adapter {unknown[0]!r} is not the model's; it has {', '.join(configs)}")
    first = configs[names[0]]
    for name in names:
        config = configs[name]
        kind = str(getattr(config, "peft_type", ""))
        if kind not in ("LORA", "PeftType.LORA"):
            raise WideTesseraError(f"adapter {name!r} is a {kind} adapter: fuse_adapters fuses LoRA adapters")
        for key in ("r", "target_modules", "rank_pattern", "use_dora", "bias", "modules_to_save", "fan_in_fan_out"):
            theirs, ours = getattr(config, key, None), getattr(first, key, None)
            if _plain(theirs) != _plain(ours):
                raise WideTesseraError(
                    f"adapter {name!r} has {key}={theirs!r} but {names[0]!r} {key}={ours!r}: adapters fuse with "
                    "others of one rank, target modules and kind; fuse each group apart"
                )
        for key, plain in _PLAIN_LORA.items():
            value = getattr(config, key, plain)
            if value not in (plain, [], ()):
                raise WideTesseraError(f"adapter {name!r} has {key}={value!r}: only {key}={plain!r} fuses")


# What a plain LoRA adapter has, which the wide layer computes: no DoRA, no trained biases (the
# base's or lora_B's own) or whole modules besides the adapters, weights in nn.Linear's layout.
_PLAIN_LORA: Dict[str, Any] = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
    "fan_in_fan_out": False,
}


def _plain(value: Any) -> Any:
    """A config value as compared: target modules are a set in one config and a list in another."""
    return sorted(value) if isinstance(value, (set, frozenset, list, tuple)) else value


def _check_layer(path: str, layer: nn.Module, names: List[str]) -> None:
    missing = [n for n in names if n not in layer.lora_A]
    if missing:
        raise WideTesseraError(f"{path} has no adapter {missing[0]!r}: every adapter must adapt the same layers")
    ranks = {n: layer.r[n] for n in names}
    if len(set(ranks.values())) > 1:
        raise WideTesseraError(f"{path}: adapters of ranks {ranks}: fuse the adapters of each rank apart")


def _wide(layer: nn.Module, names: List[str]) -> WideLoRA:
    """A PEFT LoRA Linear's adapters `names` as a WideLoRA over its base layer (not copied)."""
    dropout = [getattr(layer.lora_dropout[n], "p", 0.0) for n in names]
    wide = WideLoRA(layer.base_layer, len(names), layer.r[names[0]], [layer.scaling[n] for n in names], dropout)
    with torch.no_grad():  # in the adapters' dtype, which may not be the base's
        wide.lora_A = nn.Parameter(torch.stack([layer.lora_A[n].weight for n in names]))
        wide.lora_B = nn.Parameter(torch.stack([layer.lora_B[n].weight for n in names]))
    return wide
