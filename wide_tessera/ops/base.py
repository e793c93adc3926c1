"""The contract every op class fulfils, so the generic runner can benchmark it."""

from __future__ import annotations

import dataclasses
import math
import types
from functools import partial, wraps
from typing import Any, Callable, ClassVar, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn

from ..core import trees
from ..core.capabilities import Needs
from ..core.errors import ContractError, WideTesseraError, unknown
from ..core.job import DTYPES, BenchmarkJob, SweepParams, Work
from ..core.layout import JOINED, STACKED, Layout, Slot, own_slots, prefixed, slots_of
from ..core.user_input import check_shape
from .exact import not_the_op
from .registry import REGISTRY, RESERVED_STRATEGY_NAMES, op_names, outside_strategies

__all__ = [
    "WideOp",
    "WideChannelsOp",
    "shared_config",
    "check_alike",
    "layout_difference",
    "layout_of",
    "fusing_ops",
    "wide_module",
    "TRITON",
]


def _triton_unavailable(device: torch.device, dtype: torch.dtype, params: Dict[str, Any]) -> Optional[str]:
    from ..kernels import triton_unavailable_reason

    return triton_unavailable_reason(device)


# What a strategy built on wide_tessera.kernels needs. Timing Triton's CPU interpreter would
# report numbers no GPU user sees, so the strategy is CUDA only; the kernels' own tests run
# on the CPU under TRITON_INTERPRET=1.
TRITON = Needs(cuda=True, triton=True, probe=_triton_unavailable)


class WideOp:
    """Mixin for a wide nn.Module: N copies of one op fused into one module.

    A subclass sets BENCHMARK_SWEEPS (preset -> SweepParams) and
    BENCHMARK_STRATEGIES (its wide strategies; the first is the default, and the
    runner adds 'baseline', N separate calls), and implements:

    bench_model(**params) -> one nn.Module of the kind being fused
    bench_inputs(n, **params) -> n inputs, one per model
    from_modules(modules, strategy) -> the wide module
    pack(inputs) -> the wide input; unpack(output) -> n outputs (default: stacked on axis 0)

    Its own parameters and buffers are named as in one model and hold the N models' as LAYOUT
    says (core.layout; default stacked on a new leading axis; LAYOUTS names the exceptions), and
    its children that are wide modules are named as the model's submodules they fuse: from that,
    `model_slots()` says where each model's part of every tensor is, and from_modules fills them
    (core.layout.load_joined), and fuse()'s state_dicts() and unfuse() read them back. An op
    that holds its tensors otherwise overrides model_slots.

    It may set FUSES, the nn.Module class its from_modules fuses (nn.Linear for gemm): the
    `surgery` strategy of whole models swaps such layers for the op's wide module. It may
    implement check_params(**params), which rejects axis values that cannot work
    together (attention's d_model must divide by heads), and set STRATEGY_NEEDS (strategy ->
    capabilities.Needs: a CUDA device, a dtype, triton), so that a strategy is skipped with
    the reason where the run cannot give it, and `work(n, **params)` (flops and fewest bytes
    of one call of the N models, for the roofline). `register` checks the contract.
    """

    NAME: ClassVar[str]
    BENCHMARK_SWEEPS: ClassVar[Dict[str, SweepParams]]
    BENCHMARK_STRATEGIES: ClassVar[Tuple[str, ...]]
    STRATEGY_NEEDS: ClassVar[Dict[str, Needs]] = {}
    FUSES: ClassVar[Optional[type]] = None
    LAYOUT: ClassVar[Layout] = STACKED
    LAYOUTS: ClassVar[Dict[str, Layout]] = {}
    # How many of a layer's arguments its wide module takes, each stacked on a leading N axis as
    # the input is: surgery swaps a call that gives that many or fewer, all the models' own (a
    # recurrent layer's input and initial state: 2).
    STACKED_ARGS: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make the subclass's own from_modules keep the models' frozen parameters frozen (_frozen_as_in)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("from_modules")
        if isinstance(own, classmethod):
            cls.from_modules = classmethod(_keeping_frozen(own.__func__))

    @classmethod
    def benchmark_job(cls, preset: str = "full", **overrides: Any) -> BenchmarkJob:
        if not isinstance(preset, str) or preset not in cls.BENCHMARK_SWEEPS:
            raise unknown(f"preset for {cls.NAME}", preset, cls.BENCHMARK_SWEEPS)
        sweep = cls.BENCHMARK_SWEEPS[preset].with_overrides(**overrides)
        for params in sweep.param_grid():  # now, not when the run reaches the point
            cls.check_params(**params)
        outside = outside_strategies(cls)
        return BenchmarkJob(
            op=cls.NAME,
            preset=preset,
            strategies=[*cls.BENCHMARK_STRATEGIES, *outside],
            sweep=sweep,
            model_factory=cls.bench_model,
            input_factory=cls.bench_inputs,
            # the outside strategies travel with the job: an isolated worker has not imported them
            wide_factory=partial(_wide_module, cls, _outside_builds(cls)),
            strategy_needs=cls.strategy_needs(),
            work_factory=cls.work,
            unfit_factory=cls.unfit,
        )

    @classmethod
    def unfit(cls, n: int, **params: Any) -> Optional[str]:
        """Why N models of this op cannot run at these axis values, or None (by default any N can):
        the runner skips such a point with the reason."""
        return None

    @classmethod
    def strategy_needs(cls) -> Dict[str, Needs]:
        """What each strategy needs from the run (its own STRATEGY_NEEDS and the outside strategies')."""
        needs = {s: cls.STRATEGY_NEEDS[s] for s in cls.BENCHMARK_STRATEGIES if s in cls.STRATEGY_NEEDS}
        needs.update({s: o.needs for s, o in outside_strategies(cls).items() if o.needs is not None})
        return needs

    @classmethod
    def check_params(cls, **params: Any) -> None:
        """Raise WideTesseraError if these axis values cannot work together; by default any can."""

    @classmethod
    def check_contract(cls) -> None:
        """Raise WideTesseraError naming what is missing or malformed, so a broken op fails when registered."""
        sweeps, strategies = getattr(cls, "BENCHMARK_SWEEPS", None), getattr(cls, "BENCHMARK_STRATEGIES", None)
        problem = None
        if not issubclass(cls, nn.Module):
            problem = "is not an nn.Module"
        elif not isinstance(sweeps, dict) or not sweeps or not all(isinstance(k, str) for k in sweeps):
            problem = "needs BENCHMARK_SWEEPS: a dict of preset name -> SweepParams.of(n_values, **axes)"
        elif not isinstance(strategies, (tuple, list)) or not strategies:
            problem = "needs BENCHMARK_STRATEGIES: a tuple of its wide strategies' names"
        elif not all(isinstance(s, str) and s for s in strategies) or len(set(strategies)) != len(strategies):
            problem = f"BENCHMARK_STRATEGIES {strategies!r}: give distinct non-empty names"
        elif set(RESERVED_STRATEGY_NAMES) & set(strategies):
            problem = f"BENCHMARK_STRATEGIES {strategies!r}: {', '.join(RESERVED_STRATEGY_NAMES)} are reserved names"
        elif not isinstance(cls.STRATEGY_NEEDS, dict) or not all(
            isinstance(v, Needs) for v in cls.STRATEGY_NEEDS.values()
        ):  # names outside BENCHMARK_STRATEGIES are allowed: a subclass may drop an inherited strategy
            problem = "STRATEGY_NEEDS: give a dict of strategy names -> capabilities.Needs"
        else:
            missing = [m for m in _FACTORIES if getattr(cls, m).__func__ is getattr(WideOp, m).__func__]
            problem = f"does not implement {', '.join(missing)}" if missing else None
        if problem is not None:
            raise ContractError(f"op class {cls.__name__} {problem}")
        for preset, sweep in sweeps.items():
            if not isinstance(sweep, SweepParams):
                raise ContractError(f"op class {cls.__name__} preset {preset!r}: give a SweepParams")
            try:  # every value checked as if a user had given it
                sweep.with_overrides(n_values=sweep.n_values, **sweep.axes)
            except WideTesseraError as e:
                raise ContractError(f"op class {cls.__name__} preset {preset!r}: {e}") from None

    @classmethod
    def check_strategy(cls, strategy: Optional[str]) -> str:
        """The strategy to use: the default for None, else a known name."""
        if strategy is None:
            return cls.BENCHMARK_STRATEGIES[0]
        if strategy == "auto":  # the measured choice is fuse()'s: ops know nothing of dispatch tables
            op = f"op={cls.NAME!r}, ..." if REGISTRY.get(cls.NAME) is cls else "..."  # unregistered: fuse finds it
            raise WideTesseraError(
                f"strategy='auto': the strategy this machine measured is wide_tessera.fuse(modules, {op})'s; "
                f"from_modules takes one of {', '.join(cls.BENCHMARK_STRATEGIES)}"
            )
        if strategy not in cls.BENCHMARK_STRATEGIES:
            raise unknown(f"strategy for {cls.NAME}", strategy, cls.BENCHMARK_STRATEGIES)
        return strategy

    @classmethod
    def work(cls, n: int, **params: Any) -> Optional[Work]:
        """What one call of the N models must do (flops, fewest bytes moved), for the roofline;
        None where the op does not say."""
        return None

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        """The sweep axes one model fixes (gemm: in_features, out_features), by which `fuse`
        finds the nearest measured entry of a dispatch table; the caller's hints give the rest
        (batch, sequence length). Default: none."""
        return {}

    @classmethod
    def bench_model(cls, **params: Any) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def bench_inputs(cls, n: int, **params: Any) -> List[torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> nn.Module:
        raise NotImplementedError

    def model_slots(self) -> Dict[str, Slot]:
        """Each tensor of the wide module's state_dict: its name in one model, and where the N
        models' parts lie (LAYOUT, LAYOUTS; the children's own)."""
        assert isinstance(self, nn.Module)
        return own_slots(self, self.LAYOUT, self.LAYOUTS)

    def pack(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The default wide layout: the N inputs stacked on a new leading axis."""
        return STACKED.join(self.check_inputs(inputs))

    def input_shape(self) -> Optional[List[Union[int, str]]]:
        """Each model's input shape, as core.user_input.check_shape reads it; None where any goes."""
        return None

    def check_inputs(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The inputs as a list, after checking they are N tensors alike in shape, dtype and device,
        of the shape `input_shape` says.

        N is the module's `n` where it records one. Caught here, a wrong count or shape is a
        clear error instead of a silently wrong split of the channels, or a torch error deep in forward.
        """
        if not isinstance(inputs, (list, tuple)):
            raise WideTesseraError(f"pack needs a list or tuple of tensors, got a {type(inputs).__name__}")
        n = getattr(self, "n", None)
        if n is not None and len(inputs) != n:
            raise WideTesseraError(f"pack: {len(inputs)} inputs for {n} models; give one input per model")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise WideTesseraError(f"pack: input {i} is a {type(x).__name__}, not a Tensor")
        first = inputs[0] if inputs else None
        for i, x in enumerate(inputs):
            if (x.shape, x.dtype, x.device) != (first.shape, first.dtype, first.device):
                raise WideTesseraError(
                    f"pack: input {i} is {_describe_tensor(x)} but input 0 is {_describe_tensor(first)}; all must match"
                )
        expected = self.input_shape()
        if expected is not None and first is not None:  # the inputs are alike: input 0 speaks for all
            check_shape("pack: input 0", first.shape, expected)
        return list(inputs)

    def unpack(self, output: Any) -> List[Any]:
        """The N outputs: every tensor of the output (a tensor, or a tuple such as a GRU's output
        and hidden state) split on its leading axis."""
        leaves, structure = trees.flat(output)
        n = getattr(self, "n", None) or (leaves[0].shape[0] if leaves else 0)
        return [trees.unflat(list(models), structure) for models in zip(*(STACKED.parts(t, n) for t in leaves))]


class WideChannelsOp(WideOp):
    """An op over channels, whose wide layout puts the N models' channels side by side,
    [B, N*C, *rest] (a grouped convolution's, and the channel norms'): the stacked layout
    [N, B, C, ...] would need a copy into it on every call.

    A subclass sets `n`, `in_channels` and `out_channels` (per model).
    """

    n: int
    in_channels: int
    out_channels: int
    LAYOUT = JOINED

    def memory_format(self) -> torch.memory_format:
        """The layout `pack` gives its output."""
        return torch.contiguous_format

    def input_shape(self) -> Optional[List[Union[int, str]]]:
        return ["batch", self.in_channels, "..."]

    def pack(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return _CHANNELS.join(self.check_inputs(inputs)).contiguous(memory_format=self.memory_format())

    def unpack(self, output: torch.Tensor) -> List[torch.Tensor]:
        return [part for part in _CHANNELS.parts(output, self.n) if part is not None]


# The channels op's input and output: the N models' channels side by side, [B, N*C, ...].
_CHANNELS = Layout(dim=1, joined=True)


_FACTORIES = ("bench_model", "bench_inputs", "from_modules")


class OutsideWide(nn.Module):
    """An outside strategy's wide module: `run` (what its build made) over the op's own wide
    layout, with the op's default wide module's pack and unpack."""

    def __init__(self, wide: nn.Module, run: Callable[..., Any]):
        super().__init__()
        self.wide, self.run = wide, run

    def pack(self, inputs: Sequence[Any]) -> Any:
        return self.wide.pack(inputs)

    def unpack(self, output: Any) -> List[Any]:
        return self.wide.unpack(output)

    def model_slots(self) -> Dict[str, Slot]:
        return prefixed(slots_of(self.wide), "wide", "")

    def forward(self, *inputs: Any) -> Any:
        return self.run(*inputs)


def _keeping_frozen(from_modules: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    @wraps(from_modules)
    def from_modules_keeping_frozen(cls: type, modules: Sequence[nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
        return _frozen_as_in(modules, from_modules(cls, modules, *args, **kwargs))

    return from_modules_keeping_frozen


def _frozen_as_in(modules: Sequence[nn.Module], wide: nn.Module) -> nn.Module:
    """`wide` with each parameter that the N models have under the same name frozen where
    they froze it (requires_grad False): fused for training, a frozen layer must stay frozen.
    One frozen in some models only cannot be one wide tensor half trained (check_alike says so)."""
    own = [dict(m.named_parameters()) for m in modules]
    for name, p in wide.named_parameters():
        flags = {ps[name].requires_grad for ps in own if name in ps}
        if len(flags) > 1:
            check_alike(modules, "from_modules")
        if flags == {False}:
            p.requires_grad_(False)
    return wide


def fusing_ops() -> Dict[type, Type["WideOp"]]:
    """Module class -> the registered op that fuses it (its FUSES): what surgery swaps, what fuse() finds."""
    op_names()  # the installed plugins' ops first: one may fuse the class asked about
    return {cls.FUSES: cls for cls in REGISTRY.values() if getattr(cls, "FUSES", None) is not None}


def op_fusing(modules: Sequence[nn.Module], ops: Dict[type, Type["WideOp"]]) -> Optional[Type["WideOp"]]:
    """The op of `ops` (fusing_ops) that fuses `modules` (N of one class): its class's, or that of
    the nearest class it derives from (timm's Linear is an nn.Linear, and fuses as one), where
    they compute what that class computes (ops.exact)."""
    base = next((c for c in type(modules[0]).__mro__ if c in ops), None)
    return None if base is None or not_the_op(modules, base) is not None else ops[base]


def wide_module(cls: type, modules: Sequence[nn.Module], strategy: str) -> nn.Module:
    """The wide module of `strategy` of op class `cls`, an outside strategy's included."""
    return _wide_module(cls, _outside_builds(cls), modules, strategy)


def _outside_builds(cls: type) -> Dict[str, Callable[[nn.Module], Callable[..., Any]]]:
    """Each outside strategy's build, by name: what a job carries to workers that have not imported them."""
    return {s: o.build for s, o in outside_strategies(cls).items()}


def _wide_module(
    cls: type,
    outside: Dict[str, Callable[[nn.Module], Callable[..., Any]]],
    modules: Sequence[nn.Module],
    strategy: str,
) -> nn.Module:
    """The wide module of `strategy`: the op's own, or an outside strategy's over the op's default one."""
    if strategy not in outside:
        return cls.from_modules(modules, strategy)
    wide = cls.from_modules(modules)
    run = outside[strategy](wide)
    if not callable(run):
        raise ContractError(f"strategy {strategy!r}: its build returned {run!r}, not a function of the wide input")
    return OutsideWide(wide, run)


def itemsize(params: Dict[str, Any]) -> int:
    """Bytes per element of the point's dtype."""
    return torch.empty(0, dtype=DTYPES[params.get("dtype", "float32")]).element_size()


def _describe_tensor(x: torch.Tensor) -> str:
    return f"{tuple(x.shape)} {x.dtype} on {x.device}"


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
    """Every tensor's shape, dtype and device, and every setting a forward may read (a norm's eps,
    a dropout's p, a scale its forward branches on): a wide module, vmap and surgery all run
    model 0's code and settings with each model's tensors, so models whose settings differed
    came out wrong, silently (a per-model scale: 3.24 off)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    layout: Dict[str, Any] = {
        name: _TensorLayout(tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in tensors.items()
    }
    for path, sub in module.named_modules():
        for key, value in vars(sub).items():
            if key.startswith("_") or key == "training":
                continue
            layout.update(_settings_of(f"{path}.{key}" if path else key, value))
        # hooks run model 0's: a hook on model 1 alone was dropped by vmap and surgery (4.4 off)
        layout[f"hooks on {path or 'the model'}"] = len(sub._forward_hooks) + len(sub._forward_pre_hooks)
    return layout


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
