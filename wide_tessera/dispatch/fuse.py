"""`fuse(modules)`: the wide module where this machine's measurements say fusing wins, else a plain loop.

The decision comes from a dispatch table (dispatch.table) that `wide_tessera tune` measured:
the entry of the modules' op on this device, in their dtype, nearest in parameters, read at
N = len(modules) by the conservative rule written in `dispatch.table.match`. fuse() checks what
it is given, asks `decide` (table and case in, answer out) and hands the answer to `build`
(dispatch.build); where nothing is measured, a first call may measure (dispatch.first_call).
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
from torch import nn

from ..core.capabilities import unmet_need
from ..core.environment import capture_environment
from ..core.errors import WideTesseraError, unknown
from ..core.files import make_folder
from ..core.job import DTYPES, params_text
from ..core.user_input import check_bool, check_number
from ..measurement.controls import COMPILE_MODES
from ..measurement.modes import check_mode
from ..ops.alike import layout_difference
from ..ops.base import WideOp, fusing_ops, op_fusing
from ..ops.exact import not_the_op
from ..ops.registry import REGISTRY, get_op
from ..widen.custom import model_identity
from ..widen.functional import RANDOMNESS
from ..widen.layers import LayerChoice
from ..widen.rates import rates_differ_alone, with_own_rates
from .build import DispatchDecision, Fused, Trials, build, custom_trials, op_trials
from .first_call import FirstCall
from .table import TABLE_ENV, Case, DispatchTable, Match, decide, default_table_path, match

__all__ = ["fuse", "decide_at", "DispatchWarning", "tune_command"]


# How fuse() decides where the table has no entry: 'table' loops, 'first-call' measures.
MEASURES = ("table", "first-call")


class DispatchWarning(UserWarning):
    """No measured entry decides a case: the modules run as a loop until this case is tuned."""


# The cases already warned about: one warning per case in a process, not one per layer.
_warned: Set[Tuple[Any, ...]] = set()


def fuse(
    modules: Sequence[nn.Module],
    table: Union[None, str, Path, DispatchTable] = None,
    op: Union[None, str, type] = None,
    mode: str = "inference",
    compile: str = "none",
    cuda_graph: bool = False,
    randomness: str = "error",
    measure: str = "table",
    time_bound_s: float = 0.5,
    dtype: Optional[str] = None,
    strategy: Optional[str] = None,
    unfused: Sequence[str] = (),
    **hints: Any,
) -> Fused:
    """N modules of one kind as one module, a `Fused`: it runs the wide module of the strategy
    that won on this machine at this N, where the dispatch table says fusing wins; else the
    modules as a loop.

    Either way the result has `pack(inputs)`, `forward(packed)` and `unpack(output)`, and
    `decision` says what decided (print it). It owns what it runs: train it through its
    `parameters()` (or wide_tessera.optim, with settings per model), and read the N models back
    with `state_dicts()` or `unfuse()`. A wide module holds a copy of the modules' parameters, as
    `from_modules` makes it: the modules given are left as they were (the loop runs them). A
    frozen tensor all N hold (core.layout.held_once: a LoRA base) is held once, the models' own.
    `strategy`: run this one (one of the op's strategies, or 'loop'), whatever the table says.
    Models that differ only in a rate (an nn.Dropout's p, an nn.LeakyReLU's slope) fuse, each
    model with its own (widen.rates).
    `unfused`: layers (as `named_modules()` names them) that run as N calls inside a model fused
    by surgery, whatever the table says of their op (HFTA's partial fusion).

    table: a path or a DispatchTable; default $WIDE_TESSERA_DISPATCH, else the per-user cache
    file `wide_tessera tune` writes. op: the registered op (name or class) when the module
    class alone does not say (Expert: 'mlp' by default, 'moe_experts' for ragged tokens);
    a class no op fuses goes the custom way (vmap or surgery, as `benchmark_custom` measured
    it, under its class name). mode, compile, cuda_graph: which measurements apply
    (`--mode`, `--compile`, `--cuda-graph` of the tuning run). randomness: vmap's, for a
    custom module that draws random numbers. dtype: the entries' dtype, for modules with no
    floating-point parameters (given for modules that have them, it must be theirs). hints: the
    values of the op's sweep axes that the modules do not fix (batch=64, seq_len=128), for the
    nearest entry; an axis named as one of fuse's own keywords cannot be hinted. measure: 'table' (the table
    decides; no entry: the loop) or 'first-call' (no entry: the first call measures the loop
    against the op's strategies on the real input within `time_bound_s`, keeps the winner and
    writes the entry to the table file; see dispatch.first_call).
    """
    modules = _check_modules(modules)
    _check_options(mode, compile, randomness, cuda_graph, measure, time_bound_s)
    cls = _op_class(modules, op)
    case = _case(modules, cls, mode, compile, cuda_graph, dtype, hints)
    named = _named_layers(modules, cls, unfused)
    if strategy is not None:  # whatever the table says: it is not read, for the layers either
        return _all_unfused(_forced(modules, _trials(cls, randomness, named), case, strategy), unfused)
    loaded, source = _load_table(table, measure)
    measured = partial(_layer_loses, loaded, mode, compile, cuda_graph)
    trials = _trials(cls, randomness, measured if named is None else _either(named, measured))
    unmeasurable = _unmeasurable(modules, case.dtype)
    if unmeasurable is not None:  # nothing measured can say: the loop, with one warning
        _warn_once(case, f"{unmeasurable}: running the modules as a loop")
        answer = Match(False, None, (), None, None, f"{unmeasurable}: not fused")
    else:
        answer = decide(loaded, case, trials.known(), trials.needs, _device(modules[0]))
        if not answer.entries and measure == "first-call":
            return FirstCall(modules, trials, case, _table_file(table), time_bound_s, source)
        if not answer.entries:
            _warn_untuned(case, source)
    built = build(DispatchDecision(case, answer, source), modules, trials.make)
    if answer.fuse and not built.decision.fused:
        _warn_once(case, f"{built.decision.match.reason}: running the modules as a loop")
    return _all_unfused(built, unfused)


def _named_layers(modules: Sequence[nn.Module], cls: Optional[Type[WideOp]], unfused: Any) -> Optional[LayerChoice]:
    """Surgery's choice of the layers `unfused` names: N calls, whatever their op measured."""
    if isinstance(unfused, str) or not isinstance(unfused, (list, tuple, set, frozenset)):
        raise WideTesseraError(f"fuse: unfused={unfused!r}: give a list of layer names, as named_modules() gives them")
    if not unfused:
        return None
    if cls is not None:
        raise WideTesseraError(
            f"fuse: unfused= names layers inside a model fused by surgery; these are {cls.NAME} layers"
        )
    layers = [name for name, _ in modules[0].named_modules() if name]
    for name in unfused:
        if name not in layers:
            raise unknown("layer in unfused=", name, layers)
    chosen = {id(m.get_submodule(name)) for m in modules for name in unfused}
    return lambda op, subs: "named in unfused=" if id(subs[0]) in chosen else None


def _either(first: LayerChoice, then: LayerChoice) -> LayerChoice:
    return lambda op, subs: first(op, subs) or then(op, subs)


def _all_unfused(built: Fused, unfused: Sequence[str]) -> Fused:
    """`built`, where surgery runs every layer `unfused` names as N calls; a layer no op's wide
    module would stand for (an activation, one run under vmap) cannot be, and is refused."""
    kept: Dict[str, str] = getattr(built.runs, "unfused", {})
    swapped: List[str] = getattr(built.runs, "swapped", [])
    other = [name for name in unfused if name not in kept]
    if built.decision.strategy == "surgery" and other:
        raise WideTesseraError(
            f"fuse: unfused={list(unfused)!r}: {', '.join(other)} is no layer surgery swaps for an op's wide module "
            f"(those are: {', '.join(swapped + list(kept)) or 'none'}), so it cannot run as N calls"
        )
    return built


def decide_at(
    module: nn.Module, n: int, table: Union[None, str, Path, DispatchTable] = None, mode: str = "inference"
) -> Tuple[Match, Case]:
    """What the table says of N copies of `module` (fuse()'s answer at that N, and the case it
    asked), without building anything: how a caller sizes groups of models before making them."""
    check_mode(mode)
    cls = _op_class([module], None)
    trials = _trials(cls, "error")
    case = _case([module] * n, cls, mode, "none", False, None, {})
    loaded, _ = _load_table(table, "first-call")
    return decide(loaded, case, trials.known(), trials.needs, _device(module)), case


def _trials(cls: Optional[Type[WideOp]], randomness: str, choice: Optional[LayerChoice] = None) -> Trials:
    """The op's strategies, or (no op: a class of its own) the custom ones, surgery's layers chosen by `choice`."""
    return op_trials(cls) if cls is not None else custom_trials(randomness, choice)


def _layer_loses(
    table: DispatchTable, mode: str, compile: str, cuda_graph: bool, cls: Type[WideOp], layers: Sequence[nn.Module]
) -> Optional[str]:
    """Why N copies of a layer inside a model fused by surgery run as N calls: the table has
    measured the layer's op near its size and says the loop, as fuse() of the N layers alone would
    run it (widen.layers.LayerChoice). Nothing measured: None, the layer fuses, as the whole model
    was measured with it fused."""
    case = _case(list(layers), cls, mode, compile, cuda_graph, None, {})
    answer = match(table, case)
    if not answer.entries or answer.fuse:
        return None
    return f"{case.op} x{case.n} ({params_text(case.params)}): {answer.reason}"


# fuse(strategy=LOOP): the modules as a loop, whatever the table says
LOOP = "loop"


def _forced(modules: List[nn.Module], trials: Trials, case: Case, strategy: str) -> Fused:
    """The strategy the caller names, built (an error if it cannot be: nothing falls back)."""
    valid = [*trials.strategies, LOOP]
    if strategy not in valid:
        raise unknown(f"strategy for {case.op}", strategy, valid)
    if strategy != LOOP:
        mixed = _mixed_modes(modules)
        if mixed is not None:  # torch.func's stack_module_state raised its own error
            raise WideTesseraError(
                f"fuse: strategy {strategy!r} runs all models in one mode, and {mixed}: put them in one "
                "(m.train() or m.eval()), or use strategy='loop'"
            )
        why = unmet_need(trials.needs.get(strategy), _device(modules[0]), getattr(torch, case.dtype), case.params)
        if why is not None:
            raise WideTesseraError(f"fuse: strategy {strategy!r} cannot run here: {why}")
    fused = strategy != LOOP
    match = Match(fused, strategy if fused else None, (), None, None, f"forced: strategy={strategy!r}")
    return build(DispatchDecision(case, match, None), modules, trials.make, forced=True)


def _check_options(
    mode: str, compile: str, randomness: str, cuda_graph: bool, measure: str, time_bound_s: float
) -> None:
    check_mode(mode)
    if compile not in COMPILE_MODES:
        raise unknown("compile mode", compile, COMPILE_MODES)
    if randomness not in RANDOMNESS:
        raise unknown("randomness", randomness, RANDOMNESS)
    check_bool("cuda_graph", cuda_graph)
    if measure not in MEASURES:
        raise unknown("measure", measure, MEASURES)
    if measure == "first-call" and mode != "inference":  # it was ignored without a word
        raise WideTesseraError(
            f"measure='first-call' with mode={mode!r}: a first call measures a forward, not a training step; give "
            f"measure='table' (`wide_tessera tune --mode {mode}` measures it ahead of time)"
        )
    check_number("time_bound_s", time_bound_s, 0, 3600, what="a number of seconds")


def _device(module: nn.Module) -> str:
    tensors = [*module.parameters(), *module.buffers()]
    return str(tensors[0].device) if tensors else "cpu"


def _case(
    modules: List[nn.Module],
    cls: Optional[Type[WideOp]],
    mode: str,
    compile: str,
    cuda_graph: bool,
    dtype: Optional[str],
    hints: Dict[str, Any],
) -> Case:
    """What the modules ask the table: their op (or class), device, dtype and parameters, and N."""
    first = modules[0]
    name = cls.NAME if cls is not None else type(first).__name__
    if cls is not None:
        fixed = cls.module_params(first)
    else:
        identity = model_identity(first)
        fixed = {k: identity[k] for k in ("model", "layers")}
    device = _device(first)
    return Case(
        op=name,
        device=torch.device(device).type,
        device_name=capture_environment(device).device_name,
        dtype=_dtype_name(first, dtype),
        mode=mode,
        compile=compile,
        cuda_graph=bool(cuda_graph),
        params={**fixed, **_checked_hints(cls, name, first, hints)},
        n=len(modules),
    )


def _check_modules(modules: Any) -> List[nn.Module]:
    """The modules, if they can run as N copies at all: one class, one configuration (every
    parameter and buffer of the same name, shape, dtype and device, every setting but a rate,
    which each model keeps: widen.rates). Anything else is the loop's or the table's business,
    never an error."""
    if not isinstance(modules, (list, tuple, nn.ModuleList)) or len(modules) == 0:
        raise WideTesseraError(f"fuse needs a non-empty list of modules, got {type(modules).__name__}")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise WideTesseraError(f"fuse: module {i} is a {type(m).__name__}, not an nn.Module")
        if type(m) is not type(modules[0]):
            raise WideTesseraError(
                f"fuse: module {i} is a {type(m).__name__} but module 0 is a {type(modules[0]).__name__}; all must be "
                "of one class"
            )
    checked = list(modules)
    seen: Dict[int, int] = {}
    for i, m in enumerate(checked):
        if id(m) in seen:  # one set of weights: trained as two models, unfuse(into=) kept only the last
            raise WideTesseraError(
                f"fuse: module {i} is module {seen[id(m)]}, one object given twice: give N separate modules "
                "(copy.deepcopy(module) for each copy)"
            )
        seen[id(m)] = i
    different = layout_difference(checked)
    if different is not None and not rates_differ_alone(checked):
        different = layout_difference(with_own_rates(checked))  # what differs besides a rate
        raise WideTesseraError(f"fuse: {different}; all must have one configuration")
    return checked


def _unmeasurable(modules: Sequence[nn.Module], dtype: str) -> Optional[str]:
    """Why no measurement can decide these modules, or None: a dtype wide_tessera does not
    measure, or modules in train and eval modes at once (no wide module can be both)."""
    if dtype not in DTYPES:
        return f"the modules' dtype {dtype} is not one wide_tessera measures ({', '.join(DTYPES)})"
    return _mixed_modes(modules)


def _mixed_modes(modules: Sequence[nn.Module]) -> Optional[str]:
    """Why no wide module can run these modules: some in train mode, some in eval (it has one mode)."""
    evaluating = [i for i, m in enumerate(modules) if not m.training]
    if 0 < len(evaluating) < len(modules):
        return f"some of the modules are in train mode and some in eval mode (eval: modules {evaluating})"
    return None


def _op_class(modules: Sequence[nn.Module], op: Union[None, str, type]) -> Optional[Type[WideOp]]:
    """The registered op that fuses `modules` (None: the custom way, as for a subclass of the op's
    class with a computation of its own)."""
    if op is None:
        return op_fusing(modules, fusing_ops())
    if isinstance(op, type):
        if op not in REGISTRY.values():
            raise WideTesseraError(
                f"op {op.__name__} is not a registered op; strategy='auto' needs one (any module: "
                "wide_tessera.fuse(modules))"
            )
        cls = next(c for c in REGISTRY.values() if c is op)
    else:
        cls = get_op(op)
    fuses = getattr(cls, "FUSES", None)
    if fuses is None:
        return cls
    if not isinstance(modules[0], fuses):
        raise WideTesseraError(f"op {cls.NAME} fuses {fuses.__name__} modules, not {type(modules[0]).__name__}")
    why = not_the_op(modules, fuses)
    if why is not None:  # its wide module would compute the op's class's forward, not theirs
        raise WideTesseraError(
            f"op {cls.NAME} computes what {fuses.__name__} does, and {why}; without op=, fuse() takes "
            f"{type(modules[0]).__name__} as a class of its own"
        )
    return cls


def _dtype_name(module: nn.Module, hint: Any) -> str:
    """The modules' dtype by name ('float32'; 'float64' too, which nothing measures)."""
    floats = [t.dtype for t in module.parameters() if t.is_floating_point()]
    if floats:
        name = str(floats[0]).replace("torch.", "")
        if hint is not None and hint != name:
            raise WideTesseraError(f"fuse: dtype={hint!r} but the modules' parameters are {name}")
        return name
    if hint is None:
        return "float32"
    if hint not in DTYPES:
        raise unknown("dtype", hint, DTYPES)
    return str(hint)


def _checked_hints(cls: Optional[Type[WideOp]], name: str, module: nn.Module, hints: Dict[str, Any]) -> Dict[str, Any]:
    """The hints, each an axis of the op's sweeps that the modules do not fix, with a value of its kind."""
    if cls is None:
        if hints:
            raise WideTesseraError(
                f"fuse: {name} is measured by benchmark_custom, whose entries are matched by the class and its "
                f"layers' shapes; give no hints (got {', '.join(hints)})"
            )
        return {}
    fixed = cls.module_params(module)
    sweep = next(iter(cls.BENCHMARK_SWEEPS.values()))
    valid = [a for a in sweep.axes if a not in fixed and a != "dtype"]
    for key, value in hints.items():
        if key in fixed:
            raise WideTesseraError(f"fuse: {key}={value!r}: the modules fix {key}={fixed[key]!r}; leave it out")
        if key not in valid:
            raise unknown(f"hint for {cls.NAME}", key, valid)
        try:
            sweep.with_overrides(**{key: [value]})
        except WideTesseraError as e:
            raise WideTesseraError(f"fuse: hint {e}") from None
    return dict(hints)


def _table_file(table: Union[None, str, Path, DispatchTable]) -> Optional[str]:
    """The file a first call's measurement is written to: the table's, or the default one."""
    if isinstance(table, DispatchTable):
        return None
    if table is not None:
        return str(table)
    path = default_table_path()
    make_folder(path.parent, "dispatch table folder")
    return str(path)


def _load_table(table: Union[None, str, Path, DispatchTable], measure: str) -> Tuple[DispatchTable, Optional[str]]:
    """The table and where it came from; the default file may be missing (nothing tuned yet), and
    so may a named one that first calls will write."""
    if isinstance(table, DispatchTable):
        return table, None
    if table is not None:
        if not isinstance(table, (str, Path)) or not str(table):
            raise WideTesseraError(f"fuse: table={table!r}: give a path or a DispatchTable")
        if measure == "first-call" and not Path(table).exists():
            return DispatchTable(), f"{table} (not written yet)"
        return DispatchTable.load(table), str(table)
    path = default_table_path()
    if not path.exists():
        return DispatchTable(), f"{path} (not written yet)"
    return DispatchTable.load(path), str(path)


def _warn_once(case: Case, message: str) -> None:
    """One DispatchWarning per case and message in a process, not one per layer."""
    key = (case.op, case.device_name, case.dtype, case.mode, case.compile, case.cuda_graph, message)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{case.op} x{case.n}: {message}", DispatchWarning, stacklevel=4)


def tune_command(case: Case, n_values: Sequence[int]) -> str:
    """The `wide_tessera tune` command that measures `case` at `n_values`."""
    sets = "".join(f" --set {k}={v}" for k, v in case.params.items())
    mode = "" if case.mode == "inference" else f" --mode {case.mode}"
    return (
        f"wide_tessera tune {case.op} --device {case.device}{sets} --set dtype={case.dtype} "
        f"--n-values {','.join(map(str, n_values))}{mode}"
    )


def _warn_untuned(case: Case, source: Optional[str]) -> None:
    key = (case.op, case.device_name, case.dtype, case.mode, case.compile, case.cuda_graph)
    if key in _warned:
        return
    _warned.add(key)
    command = tune_command(case, sorted({1, case.n, *(2**i for i in range(1, case.n.bit_length() + 1))}))
    if REGISTRY.get(case.op) is None:
        command = f"wide_tessera custom MODULE:{case.op} ... --save-dispatch TABLE"
    warnings.warn(
        f"no measured entry for {case.op} x{case.n} ({params_text(case.params) or 'no parameters'}, "
        f"dtype={case.dtype}, "
        f"mode={case.mode}) on {case.device_name} in {source or 'the table given'}: running the modules as a loop. "
        f"Measure it with: {command}" + (f" (then set {TABLE_ENV} or pass table=)" if source is None else ""),
        DispatchWarning,
        stacklevel=3,
    )
