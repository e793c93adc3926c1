"""The contract every op class fulfils, so the generic runner can benchmark it."""

from __future__ import annotations

from functools import partial, wraps
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn

from ..core import trees
from ..core.capabilities import Needs
from ..core.errors import ContractError, WideTesseraError, unknown
from ..core.job import DTYPES, BenchmarkJob, SweepParams, Work
from ..core.layout import JOINED, STACKED, Layout, Slot, models_of, own_slots, prefixed, slots_of
from ..core.user_input import check_shape
from .alike import check_alike
from .exact import not_the_op
from .registry import REGISTRY, RESERVED_STRATEGY_NAMES, op_names, outside_strategies

__all__ = [
    "WideOp",
    "WideChannelsOp",
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
    # Set where pack and unpack are this layout's join and parts (the channels side by side): surgery
    # then moves a stacked value into it and back as a view (Layout.relaid), not through N parts.
    IO_LAYOUT: ClassVar[Optional[Layout]] = None

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
        n = getattr(self, "n", None) or next((t.shape[0] for t in trees.tensors(output)), 0)
        return models_of(output, n)


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
    IO_LAYOUT = Layout(dim=1, joined=True)  # the op's input and output: [B, N*C, ...]

    def memory_format(self) -> torch.memory_format:
        """The layout `pack` gives its output."""
        return torch.contiguous_format

    def input_shape(self) -> Optional[List[Union[int, str]]]:
        return ["batch", self.in_channels, "..."]

    def pack(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.IO_LAYOUT.join(self.check_inputs(inputs)).contiguous(memory_format=self.memory_format())

    def unpack(self, output: torch.Tensor) -> List[torch.Tensor]:
        return [part for part in self.IO_LAYOUT.parts(output, self.n) if part is not None]


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
