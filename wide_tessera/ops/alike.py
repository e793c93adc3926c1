"""Whether N modules are alike, as stacking them or running model 0's code with each model's
tensors needs: every tensor's shape, dtype, device and training flag, and every setting a forward
may read (`layout_of`), compared model by model (`layout_difference`)."""

from __future__ import annotations

import dataclasses
import math
import types
from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core.errors import WideTesseraError

__all__ = ["shared_config", "check_alike", "class_setting", "layout_difference", "layout_of"]


def check_alike(modules: Sequence[nn.Module], where: str) -> None:
    """That the modules are laid out alike (`layout_difference`), else an error that `where` begins:
    their state is stacked, and one of another shape would be torch's "stack expects each tensor
    to be equal size"."""
    different = layout_difference(modules)
    if different is not None:
        raise WideTesseraError(f"{where}: {different}")


def layout_difference(modules: Sequence[nn.Module]) -> Optional[str]:
    """Where the first module that is not laid out as module 0 differs (every parameter's and
    buffer's shape, dtype and device, by name), or None: N modules are stacked or run as one only
    when alike. The one check of it, for from_modules, surgery, vmap and fuse()."""
    first = layout_of(modules[0])
    for i, m in enumerate(modules[1:], start=1):
        layout = layout_of(m)
        if layout != first:
            name = next(k for k in dict.fromkeys([*first, *layout]) if first.get(k) != layout.get(k))
            theirs, ours = _described(layout.get(name)), _described(first.get(name))
            a, b = layout.get(name), first.get(name)
            if isinstance(a, _TensorLayout) and isinstance(b, _TensorLayout) and a[:3] == b[:3]:
                return f"{name!r} is frozen in some of the models and not in others: freeze it in all or none"
            if theirs == ours:  # tensor attributes of other values
                return (
                    f"module {i}'s {name!r} holds other values than module 0's, in a tensor that is neither a "
                    "parameter nor a buffer, which only module 0's would be run with: register it as a buffer "
                    "(persistent=False if it is not saved)"
                )
            return f"module {i}'s {name!r} is {theirs} but module 0's is {ours}"
    return None


def layout_of(module: nn.Module) -> Dict[str, Any]:
    """Every module's class, every tensor's shape, dtype and device, and every setting a forward may
    read (a norm's eps, a dropout's p, a scale its forward branches on): a wide module, vmap and
    surgery all run model 0's code and settings with each model's tensors, so models whose
    settings differed came out wrong, silently (a per-model scale: 3.24 off; an activation
    chosen per model, nn.ReLU in one and nn.SiLU in the other: 0.28 off)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    layout: Dict[str, Any] = {
        name: _TensorLayout(tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in tensors.items()
    }
    for path, sub in module.named_modules():
        layout[class_setting(path)] = type(sub)
        for key, value in vars(sub).items():
            if key.startswith("_") or key == "training":
                continue
            layout.update(_settings_of(f"{path}.{key}" if path else key, value))
        # hooks run model 0's: a hook on model 1 alone was dropped by vmap and surgery (4.4 off)
        layout[f"hooks on {path or 'the model'}"] = len(sub._forward_hooks) + len(sub._forward_pre_hooks)
    return layout


def class_setting(path: str) -> str:
    """The name `layout_of` gives the class of the module at `path`."""
    return f"{path or 'the model'} (its class)"


_UNCOMPARED = object()
# a NaN setting, as it is compared: NaN equals no NaN, and N models each keeping one were refused
# as models of different configurations
_NOT_A_NUMBER = object()


def _settings_of(name: str, value: Any, depth: int = 0) -> Dict[str, Any]:
    """The settings `value` holds, by name: itself where it is one (_setting); a config object's
    fields one by one (a dataclass, as transformers' configs and nanoGPT's are, a SimpleNamespace:
    models differing in `self.config.slope` fused, and all ran model 0's, 0.69 and 5.2 off); a
    functools.partial's function, arguments and keywords; a function's code and the values it
    closes over (a lambda kept per model: 0.87 and 6.0 off)."""
    if depth < 3 and (
        (dataclasses.is_dataclass(value) and not isinstance(value, type)) or isinstance(value, types.SimpleNamespace)
    ):
        fields: Dict[str, Any] = {}
        for key, field_value in vars(value).items():
            if not key.startswith("_"):
                fields.update(_settings_of(f"{name}.{key}", field_value, depth + 1))
        return fields
    if isinstance(value, partial):
        return {
            f"{name}.func": value.func,  # the same function object in every model built by one code
            **_settings_of(f"{name}.args", value.args, depth + 1),
            **_settings_of(f"{name}.keywords", value.keywords, depth + 1),
        }
    if isinstance(value, types.FunctionType) and depth < 3:  # a lambda made in __init__: the values it closes over
        kept: Dict[str, Any] = {f"{name}.code": value.__code__}
        cells = zip(value.__code__.co_freevars, value.__closure__ or ())
        for var, cell in cells:  # each on its own: a module it closes over is no setting
            if cell.cell_contents is not value:
                kept.update(_settings_of(f"{name}.{var}", cell.cell_contents, depth + 1))
        return {**kept, **_settings_of(f"{name}.defaults", value.__defaults__ or (), depth + 1)}
    setting = _setting(value)
    return {} if setting is _UNCOMPARED else {name: setting}


def _setting(value: Any) -> Any:
    """A setting as it is compared: numbers, text, flags, dtypes, slices, and tuples, lists and
    dicts of them, by value; a tensor that is neither a parameter nor a buffer (model 0's is the one
    run), by its values; _UNCOMPARED for other objects: two equal ones of a class without __eq__
    would differ by identity. (Dicts, tensors in them and slices were not compared: such
    models ran model 0's, 1.35 and 4.23 off.)"""
    if isinstance(value, torch.Tensor):
        return _TensorAttribute(value)
    if isinstance(value, (tuple, list)):
        items = [_setting(v) for v in value]
        if any(v is _UNCOMPARED for v in items):
            return _UNCOMPARED
        # (a NamedTuple's class takes its fields one by one: rebuilt as one, fusing raised a TypeError)
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):  # settings kept in a dict (a config's)
        kept = {k: _setting(v) for k, v in value.items()}
        return _UNCOMPARED if any(v is _UNCOMPARED for v in kept.values()) else kept
    if isinstance(value, float) and math.isnan(value):
        return _NOT_A_NUMBER
    plain = value is None or isinstance(value, (bool, int, float, str, slice, torch.dtype, torch.device))
    return value if plain else _UNCOMPARED


class _TensorLayout(NamedTuple):
    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    # one stacked tensor trains or not: torch's stack_module_state raised "Expected fc1.weight from
    # each model to have the same .requires_grad"
    requires_grad: bool


class _TensorAttribute:
    """A tensor a module keeps as a plain attribute, compared by value: stacking and vmap see only
    parameters and buffers, and ran model 0's for all N (a per-model table: 0.97 off)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _TensorAttribute):
            return False
        a, b = self.tensor, other.tensor
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        if torch.equal(a, b):
            return True
        # NaN where the other has NaN is the same value (torch.equal says not)
        nan = a.isnan() if a.is_floating_point() else None
        if nan is None or not torch.equal(nan, b.isnan()):
            return False
        return torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))

    def __repr__(self) -> str:
        return f"a {list(self.tensor.shape)} tensor attribute"


def _described(layout: Any) -> str:
    if layout is None:
        return "missing"
    if isinstance(layout, type):
        return f"a {layout.__module__}.{layout.__qualname__}"
    if not isinstance(layout, _TensorLayout):
        return repr(layout)  # a setting
    shape, dtype, device, _ = layout
    return f"{list(shape)} {str(dtype).replace('torch.', '')} on {device}"


def _alike(modules: Sequence[nn.Module], describe: Callable[[nn.Module], Dict[str, Any]]) -> Dict[str, Any]:
    config = describe(modules[0])
    for i, m in enumerate(modules[1:], start=1):
        for key, value in describe(m).items():
            if value != config[key]:
                raise WideTesseraError(
                    f"module {i} has {key}={value!r} but module 0 has {config[key]!r}; all modules must match"
                )
    return config


def shared_config(
    modules: Sequence[nn.Module], kind: type, describe: Callable[[nn.Module], Dict[str, Any]]
) -> Dict[str, Any]:
    """The configuration `describe` finds in all `modules`; a clear error if they are not alike.

    Their parameters must also share dtypes and devices: stacking them would otherwise
    promote or fail somewhere inside torch.
    """
    if not isinstance(modules, (list, tuple, nn.ModuleList)):
        raise WideTesseraError(f"from_modules needs a list or tuple of modules, got a {type(modules).__name__}")
    if len(modules) == 0:
        raise WideTesseraError("from_modules needs at least one module, got none")
    for i, m in enumerate(modules):
        if not isinstance(m, kind):
            raise WideTesseraError(f"module {i} is a {type(m).__name__}; expected {kind.__name__}")
    config = _alike(modules, describe)
    check_alike(modules, "from_modules")
    return config
