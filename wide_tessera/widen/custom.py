"""The job behind benchmark_custom: N copies of any nn.Module class, their inputs, and its two
strategies, `vmap` (the whole model under torch.func's vmap) and `surgery` (layer by layer)."""

from __future__ import annotations

import hashlib
import warnings
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from ..core import trees
from ..core.errors import NotApplicable, WideTesseraError, one_line, unknown
from ..core.job import BenchmarkJob, SweepParams
from ..ops.alike import layout_difference
from .functional import RANDOMNESS, WideFunctional
from .layers import LayerChoice
from .moe import WideSparseMoe, is_sparse_moe, loops_over_experts
from .rates import rates_differ_alone, with_own_rates
from .surgery import WideSurgery

__all__ = [
    "custom_job",
    "custom_wide",
    "factory_name",
    "model_identity",
    "CUSTOM_STRATEGIES",
    "RANDOMNESS",
    "INPUT_DTYPES",
]

# vmap: the whole model under vmap; surgery: layers an op fuses swapped for its wide module.
CUSTOM_STRATEGIES = ("vmap", "surgery")

# An input's dtype: 'float' follows the run's dtype; integer inputs (token ids) are drawn
# uniformly from [0, int_high); bool ones are 0 or 1.
INPUT_DTYPES: Dict[str, Optional[torch.dtype]] = {
    "float": None,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


# A module's try on one input: a warning when two builds are identical, and its identity (_check_fits).
Fits = Tuple[Optional[str], Dict[str, str]]


def custom_job(
    model_class: Callable[..., nn.Module],
    input_shape: Any,
    n_values: Sequence[int],
    name: Optional[str],
    dtype: str,
    model_kwargs: Dict[str, Any],
    run_check: Callable[[Callable[[], Fits]], Fits] = lambda check: check(),
    input_dtype: Any = None,
    int_high: Optional[int] = None,
    input_factory: Optional[Callable[[], Any]] = None,
    randomness: str = "error",
    train: bool = False,
) -> BenchmarkJob:
    """A job for N copies of `model_class(**model_kwargs)`, each fed its own input.

    `model_class` is anything that returns a new nn.Module when called: the class, or a
    function (`make_layer`, `timm.create_model`); the N models it builds must differ, or
    a strategy that mixes them up could not be caught, so identical ones are a warning.
    One model's input is `input_shape` (a shape, or a list of shapes for several inputs)
    with `input_dtype` (one name of INPUT_DTYPES, or one per input), or whatever
    `input_factory()` returns (a tensor, a tuple of positional or a dict of keyword arguments).
    The module is tried on one input first; `run_check(check)` runs that try (the API runs it in a worker process
    under `isolate`, so a module that crashes or hangs cannot take the caller with it).
    """
    _check_arguments(model_class, name, randomness, train)
    make_input = _input_maker(input_shape, input_dtype, int_high, input_factory)
    extra: Dict[str, List[Any]] = {"train": [True]} if train else {}
    if randomness != "error":
        extra["randomness"] = [randomness]
    given = "the input of input_factory()" if input_factory is not None else f"input_shape {input_shape}"
    same, identity = run_check(partial(_check_fits, model_class, make_input, given, model_kwargs, randomness, train))
    if same:
        warnings.warn(same, stacklevel=3)
    op = identity.pop("class")
    fixed = {k: [v] for k, v in identity.items()}  # what a dispatch entry of this model is matched by
    sweep = SweepParams.of([1], **extra, **fixed, dtype=["float32"]).with_overrides(n_values=n_values, dtype=dtype)
    return BenchmarkJob(
        op=name or op,
        preset="custom",
        strategies=list(CUSTOM_STRATEGIES),
        sweep=sweep,
        # partials of module-level functions, not lambdas: an isolated run pickles the job
        model_factory=partial(_build_model, model_class, model_kwargs),
        input_factory=partial(_inputs, make_input),
        wide_factory=partial(custom_wide, randomness=randomness),
        train=train,
        seeded_check_factory=None if randomness == "error" else partial(custom_wide, randomness="same"),
    )


def _check_arguments(model_class: Any, name: Optional[str], randomness: str, train: bool) -> None:
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise WideTesseraError(f"name={name!r}: give the result's name as a non-empty string")
    if isinstance(model_class, nn.Module):  # one model, where N new ones are needed
        raise WideTesseraError(
            f"got an instance of `{type(model_class).__name__}`; pass the class, or a function returning a new model"
        )
    if not callable(model_class):
        raise WideTesseraError(
            f"model_class={model_class!r} is not callable; pass an nn.Module class, or a function returning a new model"
        )
    if randomness not in RANDOMNESS:
        raise unknown("randomness", randomness, RANDOMNESS)
    if not isinstance(train, bool):
        raise WideTesseraError(f"train={train!r}: give True or False")


def _input_maker(
    input_shape: Any, input_dtype: Any, int_high: Optional[int], input_factory: Optional[Callable[[], Any]]
) -> Callable[[], Any]:
    """What makes one model's input: `input_factory`, or random tensors of `input_shape`."""
    if input_factory is None:
        return partial(_random_input, _input_specs(input_shape, input_dtype, int_high), int_high)
    if input_shape is not None or input_dtype is not None or int_high is not None:
        raise WideTesseraError("give input_shape (with input_dtype, int_high) or input_factory, not both")
    if not callable(input_factory):
        raise WideTesseraError(f"input_factory={input_factory!r} is not callable; give a function of no arguments")
    return input_factory


def custom_wide(
    modules: Sequence[nn.Module], strategy: str, randomness: str = "error", choice: Optional[LayerChoice] = None
) -> nn.Module:
    """The wide module of a custom job's strategy (`choice`: surgery's, which layers run as N calls),
    of copies that read each model's rates from buffers where the models differ only in rates."""
    if layout_difference(modules) is not None and rates_differ_alone(modules):
        modules = with_own_rates(modules)
    if strategy == "surgery":  # a sparse MoE block is swapped whole: N·E experts in one block
        if is_sparse_moe(modules[0]):
            return WideSparseMoe(modules, randomness)
        return WideSurgery(modules, randomness, choice)
    looping = next((path for path, m in modules[0].named_modules() if loops_over_experts(m)), None)
    if looping is not None:
        where = f"{type(modules[0]).__name__}{'.' + looping if looping else ''}"
        raise NotApplicable(
            f"{where}'s experts loop over the experts a batch hit (aten::nonzero, a shape vmap "
            "cannot batch); surgery makes the N blocks one of N·E experts"
        )
    return WideFunctional.from_modules(modules, strategy, randomness)


# (shape, dtype or None for the run's float dtype) of each input
InputSpec = Tuple[Tuple[int, ...], Optional[torch.dtype]]


# The largest size of an input's axis: a size past int64 was torch's own overflow, C++ frames and
# all, without the value (--input-shape 99999999999999999999,16).
MAX_SIZE = 2**31 - 1


def _input_specs(input_shape: Any, input_dtype: Any, int_high: Optional[int]) -> List[InputSpec]:
    """Each input's shape and dtype, checked: one clear error before any model is built."""
    several = (
        isinstance(input_shape, list) and bool(input_shape) and all(isinstance(s, (tuple, list)) for s in input_shape)
    )
    shapes = list(input_shape) if several else [input_shape]
    for shape in shapes:
        ok = isinstance(shape, (tuple, list, torch.Size)) and len(shape) > 0
        if not ok or any(isinstance(d, bool) or not isinstance(d, int) or not 0 < d <= MAX_SIZE for d in shape):
            what = "each input_shape" if several else "input_shape"
            raise WideTesseraError(
                f"{what} must be a non-empty tuple of positive ints up to {MAX_SIZE} (several inputs: a list of "
                f"them), got {shape!r}"
            )
    names = input_dtype if isinstance(input_dtype, (list, tuple)) else [input_dtype] * len(shapes)
    if len(names) != len(shapes):
        raise WideTesseraError(f"input_dtype {list(names)}: give one per input ({len(shapes)} input shape(s))")
    specs = []
    for i, (shape, dtype_name) in enumerate(zip(shapes, names)):
        dtype_name = "float" if dtype_name is None else dtype_name
        if dtype_name not in INPUT_DTYPES:
            raise unknown("input_dtype", dtype_name, INPUT_DTYPES)
        dtype = INPUT_DTYPES[dtype_name]
        if dtype is not None and dtype != torch.bool and not (isinstance(int_high, int) and int_high > 0):
            raise WideTesseraError(
                f"input {i} is {dtype_name}: give int_high (--int-high), a positive int, the exclusive bound of its "
                "values "
                f"(e.g. an embedding's num_embeddings); got {int_high!r}"
            )
        specs.append((tuple(shape), dtype))
    if int_high is not None and all(dtype in (None, torch.bool) for _, dtype in specs):  # it was dropped unsaid
        raise WideTesseraError(
            f"int_high={int_high!r} (--int-high) bounds integer inputs, and no input is one: give input_dtype "
            "(--input-dtype) int64 to the inputs it bounds, or leave it out"
        )
    return specs


def _random_input(specs: List[InputSpec], int_high: Optional[int]) -> Any:
    """One model's input: a tensor, or a tuple of them for a module of several inputs."""
    xs = tuple(
        torch.randn(shape)
        if dtype is None
        else torch.randint(0, 2 if dtype == torch.bool else cast(int, int_high), shape).to(dtype)  # checked given
        for shape, dtype in specs
    )
    return xs[0] if len(xs) == 1 else xs


def _inputs(make_input: Callable[[], Any], n: int, **_: Any) -> List[Any]:
    return [make_input() for _ in range(n)]


def _build_model(model_class: Callable[..., nn.Module], model_kwargs: Dict[str, Any], **_: Any) -> nn.Module:
    return model_class(**model_kwargs)


def factory_name(model_class: Callable[..., nn.Module]) -> str:
    """What builds the models, as a user wrote it: `Expert`, `make_layer`, `partial(...)`'s function."""
    target = getattr(model_class, "func", model_class)  # functools.partial
    return getattr(target, "__name__", type(target).__name__)


def _one_input(make_input: Callable[[], Any]) -> Any:
    """One input from the user's factory, checked; its failure, sys.exit() included (it ended the
    run with exit status 0 and no output), is one line."""
    try:
        x = make_input()
    except (Exception, SystemExit) as e:  # noqa: BLE001  the user's factory's own error, in one line
        raise WideTesseraError(f"input_factory() failed: {one_line(e)}") from None
    if not isinstance(x, (torch.Tensor, tuple, dict)) or not trees.tensors(x):
        raise WideTesseraError(
            f"input_factory() returned {type(x).__name__}; give a Tensor, a tuple of positional arguments or a dict "
            "of keyword arguments, holding tensors"
        )
    return x


def _form(x: Any) -> str:
    """An input's kind, and each tensor's shape and dtype: 'Tensor [2, 16] float32'."""
    shapes = [f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in trees.tensors(x)]
    return f"{type(x).__name__} {', '.join(shapes)}"


def _check_fits(
    model_class: Callable[..., nn.Module],
    make_input: Callable[[], Any],
    given: str,
    model_kwargs: Dict[str, Any],
    randomness: str,
    train: bool,
) -> Fits:
    """Build one model and call it on one input (`given` names where it came from); a clear
    error for what would fail every point. Returns a warning when two builds are identical,
    and the model's identity (model_identity)."""
    builds = _built_twice(model_class, model_kwargs)
    model = builds[0].train(train)
    name = type(model).__name__
    x = _one_input(make_input)
    again = _one_input(make_input)
    if _form(again) != _form(x):  # the N models' inputs are stacked: every point would fail on it
        raise WideTesseraError(
            f"input_factory() returned {_form(x)}, then {_form(again)}: give inputs of one shape and dtype at every "
            "call"
        )
    before = {k: t.clone() for k, t in model.state_dict().items()}
    outputs = _called_twice(model, x, given)
    # equal_nan: a model whose output is NaN gives NaN twice, which is no sign of random numbers
    same = all(_same(a, b) for a, b in zip(trees.tensors(outputs[0]), trees.tensors(outputs[1])))
    changed = [k for k, t in model.state_dict().items() if not _same(t, before[k])]
    if not same and changed and not train:
        # a buffer its forward updates (a step counter): stateful, not random; it was told to give randomness
        raise WideTesseraError(
            f"{name}'s forward updates its own buffers ({', '.join(changed)}) and its output depends on them: two "
            "calls on one input differ, so N separate calls and a fused one cannot be compared"
        )
    if not same and randomness == "error":
        raise WideTesseraError(
            f"{name} draws random numbers (two calls on one input "
            f"differ{'; dropout in train mode?' if train else ''}): "
            "give randomness='different' (--randomness different; each model its own draws) or 'same' (one draw for "
            "all)"
        )
    return _identical(*builds), model_identity(model)


def _built_twice(model_class: Callable[..., nn.Module], model_kwargs: Dict[str, Any]) -> List[nn.Module]:
    """Two models, built from two generator states: they differ unless a seed is fixed inside."""
    name = factory_name(model_class)
    builds = []
    for seed in (1, 2):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            try:
                builds.append(model_class(**model_kwargs))
            except (Exception, SystemExit) as e:  # noqa: BLE001  the user's class's own error, in one line
                raise WideTesseraError(f"cannot build {name}(**{model_kwargs!r}): {one_line(e)}") from None
        if not isinstance(builds[-1], nn.Module):
            raise WideTesseraError(
                f"{name}(**{model_kwargs!r}) returned {type(builds[-1]).__name__}, not an nn.Module; pass an "
                "nn.Module class, or a function returning a new model"
            )
    return builds


def _called_twice(model: nn.Module, x: Any, given: str) -> List[Any]:
    """The model's outputs on `x` from two generator states: where they differ, the model draws
    random numbers. An output must hold a tensor."""
    name = type(model).__name__
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        try:
            with torch.no_grad():
                outputs.append(trees.call(model, trees.clone(x)))  # a model may change its input in place
        except Exception as e:  # noqa: BLE001  the user's model's own error, in one line
            raise WideTesseraError(f"{given} does not fit {name}: {one_line(e)}") from None
    if not trees.tensors(outputs[0]):
        raise WideTesseraError(
            f"{name}.forward returns {type(outputs[0]).__name__} holding no tensor; benchmark_custom needs a Tensor, "
            "or a tuple, list, dict or ModelOutput holding them"
        )
    return outputs


def model_identity(model: nn.Module) -> Dict[str, str]:
    """What a dispatch entry of a custom model is keyed by: its class's name, the class itself
    (module and qualified name: another class of that name is another model) and a digest of
    its layers' shapes (another configuration of the class is another model)."""
    cls = type(model)
    shapes = sorted((k, tuple(t.shape)) for k, t in [*model.named_parameters(), *model.named_buffers()])
    digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:10]
    return {"class": cls.__name__, "model": f"{cls.__module__}.{cls.__qualname__}", "layers": digest}


def _identical(a: nn.Module, b: nn.Module) -> Optional[str]:
    """A warning when two models built from different generator states have the same weights."""
    if a is b:
        return (
            f"the factory returned one {type(a).__name__} object for two builds, so the N models would be one module "
            "and a strategy that mixes them up passes the check; return a new model from each call"
        )
    first, second = a.state_dict(), b.state_dict()
    weights = [k for k, t in first.items() if t.is_floating_point() and t.numel() > 1]
    if not weights or any(not _same(first[k], second[k]) for k in weights):
        return None
    return (
        f"every {type(a).__name__} built is the same (the same initial weights, whatever the random state: a fixed "
        "seed inside?), so the N models are identical and a strategy that mixes them up passes the check; build "
        "each with its own weights"
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
    return torch.equal(a, b)
