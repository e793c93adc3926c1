"""What one timed call does in each mode, and what a training-mode check compares.

inference: the N outputs under no_grad (the default).
forward: the same forward with autograd recording (parameters and float inputs need gradients).
backward: the backward pass alone, from one recorded forward kept for every call.
forward_backward: forward, then the gradients of every parameter and float input.
train_step: forward, backward and one SGD step over every parameter, one learning rate for all:
    the op's training path, checked as strictly as its gradients.
train: one step of what a hyperparameter sweep runs (measurement.recipe): forward, backward,
    each model clipped, stepped by AdamW with its own settings and scheduled; checked by the
    N models' parameters after TRAIN_STEPS steps against N separate torch trainings.

Both sides do the same in each mode: the baseline over N models and N inputs, a wide
strategy over its wide module and the packed input. The gradient flowing back is that of
a fixed random weighting of every output (`loss`), the same for both sides, so no side
gains from an output that happens to be summed. The optimizer is SGD with momentum (see
OPTIMIZER) in torch's default implementation for the device, N of them over N models, one
over the wide module; the optimizer controls step the N models with one foreach or fused
SGD over all their parameters (see controls).

A training-mode check compares, besides the N outputs, each model's input gradients
(the wide side differentiates through `pack`), and the module state in the wide
module's own layout: the N models' parameter gradients (then, after train_step, their
updated parameters, and their persistent buffers after the call: BatchNorm's running
statistics) are joined by the strategy's own `from_modules`, exactly as their weights
were, and compared tensor by tensor with the wide module's. A strategy whose parameters
are not a rearrangement of the models' (a block-diagonal weight with zeros off the
diagonal) gets gradients there that no model has, and is incorrect for training.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..core import trees
from ..core.correctness import ADAM_TRAINED, Check, check_outputs, check_trained
from ..core.errors import unknown
from ..core.kept import putting_back
from .recipe import TRAIN_STEPS, Recipe

__all__ = [
    "MODES",
    "TRAINING_MODES",
    "check_mode",
    "Side",
    "Outcome",
    "timed_call",
    "outcome",
    "compare",
    "grad_weights",
    "preserved",
]

MODES = ("inference", "forward", "backward", "forward_backward", "train_step", "train")
TRAINING_MODES = MODES[1:]

# SGD with momentum: its first step moves every parameter by lr times its gradient, so a
# check of the updated parameters is as strict as the gradient check. Adam's first step is
# lr * g / (|g| + eps), about lr * sign(g): it flips on gradients near zero from summation
# order alone and would fail a correct strategy.
OPTIMIZER = partial(torch.optim.SGD, lr=0.01, momentum=0.9)


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise unknown("mode", mode, MODES)
    return mode


@dataclass
class Side:
    """One side of a comparison: the baseline's N models or a strategy's wide module.

    forward(x) -> the side's output, for x = pack(inputs) made from the N models' inputs;
    unpack(output) -> the N models' outputs; modules: what holds the side's parameters (N
    models, or one wide module: `wide`); optimizer: None, each module stepped by its own optimizer
    in torch's default implementation, or 'foreach'/'fused', all modules by one optimizer
    in that implementation; recipe: the train mode's per-model settings.
    """

    forward: Callable[[Any], Any]
    pack: Callable[[List[Any]], Any]
    unpack: Callable[[Any], List[Any]]
    modules: List[nn.Module]
    optimizer: Optional[str] = None
    wide: bool = False
    recipe: Optional[Recipe] = None

    def parameters(self) -> List[torch.Tensor]:
        return [p for m in self.modules for p in _trained(m)]

    def optimizers(self) -> List[torch.optim.Optimizer]:
        """What steps the side's parameters in train_step (none for a module with nothing to train)."""
        groups = [_trained(m) for m in self.modules] if self.optimizer is None else [self.parameters()]
        implementation = {} if self.optimizer is None else {self.optimizer: True}
        return [OPTIMIZER(params, **implementation) for params in groups if params]


def _trained(m: nn.Module) -> List[torch.Tensor]:
    return [p for p in m.parameters() if p.requires_grad]


def requiring_grad(tree: Any) -> Any:
    """A copy whose floating-point tensors are fresh leaves that need gradients (an op's input
    is some earlier layer's output in a model); integer ones (token ids) are kept."""
    return tree_map(
        lambda t: t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        tree,
    )


def as_layer_output(tree: Any) -> Any:
    """The tensors of `tree` that need gradients as an earlier layer's outputs would be: copies
    that are no leaves, so a module may write them in place, their gradients flowing back to the
    leaves. transformers' SwitchTransformersSparseMLP multiplies its input by jitter in place in
    training, which torch refuses on a leaf that needs gradients: its train_step point failed."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t, tree)


def grad_weights(reference: Sequence[Any], seed: int) -> List[Any]:
    """Per model, a fixed random tensor for each floating-point output: what `loss` weights it by."""
    generator = torch.Generator().manual_seed(seed)

    def weight(t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return None
        return torch.randn(t.shape, generator=generator).to(device=t.device, dtype=t.dtype)

    return [trees.map_leaves(weight, out) for out in reference]


def loss(outputs: Sequence[Any], weights: Sequence[Any]) -> torch.Tensor:
    """sum over models and outputs of <output, weight>: its gradient for each output is the weight."""
    total = 0
    for out, w in zip(outputs, weights):
        for o, g in zip(trees.flat(out)[0], trees.flat(w)[0]):
            if g is not None:
                total = total + (o * g).sum()
    return total


def _float_leaves(tree: Any) -> List[torch.Tensor]:
    return [t for t in trees.tensors(tree) if t.requires_grad]


def timed_call(
    mode: str, side: Side, inputs: List[Any], weights: List[Any], writes_input: bool = False
) -> Callable[[], object]:
    """The call to time in `mode` on `side`, over inputs (the N models' own, made here into
    fresh leaves and packed once, outside the timed call). `writes_input`: the models write their
    input in place (Outcome.input_written), so in the training modes each call is given its own
    copy (`as_layer_output`), on every side alike: the only calls that pay for a copy."""
    x = side.pack(inputs) if mode == "inference" else requiring_grad(side.pack(inputs))
    if mode == "inference":
        return partial(side.forward, x)
    fed: Callable[[Any], Any] = as_layer_output if writes_input else (lambda x: x)

    def forward(x: Any) -> Any:
        return side.forward(fed(x))

    if mode == "forward":
        return _with_grad(forward, x)
    wrt = side.parameters() + _float_leaves(x)
    if mode == "backward":
        with torch.enable_grad():
            recorded = loss(side.unpack(forward(x)), weights)
        return partial(torch.autograd.grad, recorded, wrt, retain_graph=True, allow_unused=True)
    if mode == "forward_backward":
        return _with_grad(
            lambda x: torch.autograd.grad(loss(side.unpack(forward(x)), weights), wrt, allow_unused=True), x
        )
    if mode == "train":
        assert side.recipe is not None
        stepper = side.recipe.stepper(side.modules, side.wide, side.optimizer)

        def train(x: Any) -> None:
            loss(side.unpack(forward(x)), weights).backward()
            stepper()

        return _with_grad(train, x)
    optimizers = side.optimizers()

    def train_step(x: Any) -> None:
        loss(side.unpack(forward(x)), weights).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return _with_grad(train_step, x)


def _with_grad(fn: Callable[[Any], Any], x: Any) -> Callable[[], Any]:
    def call() -> Any:
        with torch.enable_grad():
            return fn(x)

    return call


@dataclass
class Outcome:
    """What one checked call in a training mode did: the N outputs, each model's input
    gradients, and per module of the side its parameter gradients, its persistent buffers
    after the call, and (train_step) its parameters after the step. In the train mode:
    the first step's outputs, and `trained`, each model's parameters and buffers after
    TRAIN_STEPS steps."""

    outputs: List[Any]
    input_grads: List[Any]
    grads: List[Dict[str, torch.Tensor]]
    buffers: List[Dict[str, torch.Tensor]]
    stepped: Optional[List[Dict[str, torch.Tensor]]]
    trained: Optional[List[Dict[str, torch.Tensor]]] = None
    # the reference's only: the same trainings, each gradient carrying rounding noise (outcome's `twin`)
    twin: Optional[List[Dict[str, torch.Tensor]]] = None
    # whether the side's modules wrote their input in place (timed_call's writes_input)
    input_written: bool = False


def outcome(
    mode: str, side: Side, inputs: List[Any], weights: List[Any], seeded: Callable[[Callable], Any], twin: bool = False
) -> Outcome:
    """One forward and backward (and step, for train_step) of `side` on the N models' inputs,
    the gradients taken through `pack`; the side's modules are left as they were."""
    with preserved(side.modules):
        if mode == "train":
            return _train_steps(side, inputs, weights, seeded, twin)
        return _outcome(mode, side, inputs, weights, seeded)


def _train_steps(
    side: Side, inputs: List[Any], weights: List[Any], seeded: Callable[[Callable], Any], twin: bool
) -> Outcome:
    """TRAIN_STEPS steps of the train mode on one batch: the first step's outputs, and the N
    models' state at the end. `twin`: before each step's forward, every parameter is nudged by
    random rounding noise (up to ROUNDING_UNITS units of its dtype), as another summation order
    nudges what it computes: how far the training carries such differences
    (core.correctness.check_trained's twin)."""
    noise = torch.Generator().manual_seed(0)
    assert side.recipe is not None
    stepper = side.recipe.stepper(side.modules, side.wide, side.optimizer)
    x = side.pack(inputs)
    first: List[Any] = []
    for _ in range(TRAIN_STEPS):
        if twin:
            _round_differently(side.parameters(), noise)
        with torch.enable_grad():
            outputs = side.unpack(seeded(lambda: side.forward(x)))
            if not first:
                first = [_detached(o) for o in outputs]
            loss(outputs, weights).backward()
        stepper()
    return Outcome(first, [], [], [], None, side.recipe.states(side.modules, side.wide))


# How many units of rounding the twin's parameters are nudged by, at most, each step.
ROUNDING_UNITS = 2.0


@torch.no_grad()
def _round_differently(params: List[torch.Tensor], generator: torch.Generator) -> None:
    """Each floating-point parameter nudged by random rounding noise, up to ROUNDING_UNITS units of its dtype."""
    for p in params:
        if p.is_floating_point():
            units = torch.rand(p.shape, generator=generator, dtype=torch.float64) * 2 - 1
            scale = ROUNDING_UNITS * torch.finfo(p.dtype).eps
            p.mul_((1 + units * scale).to(device=p.device, dtype=p.dtype))


@contextmanager
def preserved(modules: Sequence[nn.Module], tensors: Sequence[torch.Tensor] = ()) -> Iterator[Callable[[], None]]:
    """Whatever the block does to the modules' parameters, buffers and gradients, and to `tensors`
    (the inputs a forward may write in place), is undone after it.

    The block gets the undoing as a function too, to undo what it has done so far without taking
    the modules' state again (a first call of 10,000 Linears spent 0.3 s a copy of it).
    Only tensors the block changed are written back: writing one bumps its version, and a
    forward recorded for the backward mode, which saved the parameters, could then not run.
    Changed means changed in value: batch norm updates its running statistics inside its
    kernel without bumping their version.
    """
    # every buffer, the non-persistent ones too (a call counter left at 628 after a first call),
    # and every gradient as it was (a first call wiped what the user had accumulated)
    live = list(dict.fromkeys([*(t for m in modules for t in (*m.parameters(), *m.buffers())), *tensors]))
    saved = [t.detach().clone() for t in live]
    grads = [(p, p.grad) for m in modules for p in m.parameters()]
    subs = list(dict.fromkeys(sub for m in modules for sub in m.modules()))
    # and which tensor each module holds as each buffer: a forward that assigns one (self.c = self.c
    # + x) leaves another there, which writing the values back did not undo (a first call's
    # measurement left it stepped once a timed call: outputs 644 off the separate models')
    held = [(sub, dict(sub._buffers)) for sub in subs]
    # and each plain value a module keeps (core.kept: a call counter, self.calls += 1, was left at
    # 622 after a first call)
    put_back = putting_back(subs)

    def restore() -> None:
        for sub, buffers in held:
            sub._buffers.update(buffers)
        put_back()
        with torch.no_grad():
            for t, value in zip(live, saved):
                if not torch.equal(t, value):
                    t.copy_(value)
        for p, grad in grads:
            p.grad = grad

    try:
        yield restore
    finally:
        restore()


def _outcome(
    mode: str, side: Side, inputs: List[Any], weights: List[Any], seeded: Callable[[Callable], Any]
) -> Outcome:
    given = requiring_grad(inputs)
    leaves = [_float_leaves(x) for x in given]
    with torch.enable_grad():  # (points are measured under no_grad: a copy made there is cut off from its leaf)
        fed = as_layer_output(given)
        outputs = side.unpack(seeded(lambda: side.forward(side.pack(fed))))
        # every parameter: one that does not need a gradient gets none, and differs from a model's that has one
        named = [list(m.named_parameters()) for m in side.modules]
        params = [p for ps in named for _, p in ps if p.requires_grad]
        grads = iter(torch.autograd.grad(loss(outputs, weights), params + sum(leaves, []), allow_unused=True))
    per_module = [{k: _or_zeros(next(grads) if p.requires_grad else None, p) for k, p in ps} for ps in named]
    stepped = None
    if mode == "train_step":
        for ps, g in zip(named, per_module):
            for k, p in ps:
                p.grad = g[k].clone() if p.requires_grad else None
        for optimizer in side.optimizers():
            optimizer.step()
        stepped = [{k: p.detach().clone() for k, p in ps} for ps in named]
    buffers = [_persistent_buffers(m) for m in side.modules]
    input_grad_trees = [
        tree_map(lambda t: _or_zeros(next(grads), t) if isinstance(t, torch.Tensor) and t.requires_grad else None, x)
        for x in given
    ]
    written = any(t._version > 0 for t in trees.tensors(fed))  # a fresh copy is at version 0
    outs = [_detached(o) for o in outputs]
    return Outcome(outs, input_grad_trees, per_module, buffers, stepped, input_written=written)


def _or_zeros(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A gradient autograd did not reach (an unused parameter) is zero."""
    return torch.zeros_like(like) if grad is None else grad.detach()


def _detached(tree: Any) -> Any:
    return trees.map_leaves(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _persistent_buffers(m: nn.Module) -> Dict[str, torch.Tensor]:
    """The buffers a state_dict holds (running statistics), not scratch a module keeps for itself;
    not a parameter under its second name (GPT-2's lm_head tied to its embedding), which was
    taken for a buffer and wrote the weight over the gradient joined for the check."""
    names = {k for k, _ in m.named_parameters(remove_duplicate=False)}
    return {k: v.detach().clone() for k, v in m.state_dict().items() if k not in names}


def _carrying(
    modules: Sequence[nn.Module], params: Sequence[Dict[str, torch.Tensor]], buffers: Sequence[Dict[str, torch.Tensor]]
) -> List[nn.Module]:
    """Copies of `modules` whose parameters that train hold `params` and whose buffers hold
    `buffers`. A frozen one keeps its value: whether the wide module holds it once depends on it
    (core.layout.held_once), and N models' frozen tensors that differ, given their gradients
    (zeros), were joined as one tensor where the wide module stacks them."""
    copies = []
    for m, ps, bs in zip(modules, params, buffers):
        c = copy.deepcopy(m)
        with torch.no_grad():
            for k, p in c.named_parameters():
                if k in ps and p.requires_grad:
                    p.copy_(ps[k])
        c.load_state_dict({**c.state_dict(), **bs})
        copies.append(c)
    return copies


def compare(
    reference: Outcome,
    got: Outcome,
    modules: Sequence[nn.Module],
    join: Optional[Callable[[List[nn.Module]], nn.Module]],
    tol: float,
) -> Check:
    """A side's verdict: its outputs, each model's input gradients, and its modules' gradients,
    buffers and stepped parameters against the reference's. For a wide module, the reference's
    are first joined by `join` (the strategy's from_modules) into its layout; a loop over the N
    models (join None) is compared model by model."""

    if reference.trained is not None and got.trained is not None:
        outputs = check_outputs(got.outputs, reference.outputs, tol)
        if not outputs.correct:
            return Check(False, outputs.max_rel_error, tol, f"output: {outputs.error}")
        trained = check_trained(got.trained, reference.trained, ADAM_TRAINED, reference.twin)
        if not trained.correct:
            return Check(False, trained.max_rel_error, tol, f"after {TRAIN_STEPS} steps, {trained.error}")
        return Check(True, max(outputs.max_rel_error or 0.0, trained.max_rel_error or 0.0), tol, None,
                     list(outputs.per_model_rel_error), list(outputs.per_model_abs_error))  # fmt: skip
    if join is None:
        grads, buffers, stepped = reference.grads, reference.buffers, reference.stepped
    else:
        joined = join(_carrying(modules, reference.grads, reference.buffers))
        grads = [{k: p.detach() if p.requires_grad else torch.zeros_like(p) for k, p in joined.named_parameters()}]
        buffers = [_persistent_buffers(joined)]
        if reference.stepped is not None:
            stepped = [_named_parameters(join(_carrying(modules, reference.stepped, reference.buffers)))]
    checks = [
        ("output", check_outputs(got.outputs, reference.outputs, tol)),
        ("input gradient", check_outputs(got.input_grads, reference.input_grads, tol)),
        ("parameter gradient", _check_modules(got.grads, grads, tol)),
        ("buffer", _check_modules(got.buffers, buffers, tol)),
    ]
    if reference.stepped is not None:
        checks.append(("updated parameter", _check_modules(got.stepped, stepped, tol)))
    for what, c in checks:
        if not c.correct:
            return Check(False, c.max_rel_error, tol, f"{what}: {c.error}")
    (_, outputs), (_, input_grads) = checks[:2]
    per_model = [max(a, b) for a, b in zip(outputs.per_model_rel_error, input_grads.per_model_rel_error)]
    worst = max(c.max_rel_error for _, c in checks)
    return Check(True, worst, tol, None, per_model, list(outputs.per_model_abs_error))


def _check_modules(got: List[Dict[str, torch.Tensor]], expected: List[Dict[str, torch.Tensor]], tol: float) -> Check:
    worst = 0.0
    for i, (g, e) in enumerate(zip(got, expected)):
        c = _check_named(g, e, tol)
        if not c.correct:
            return Check(False, c.max_rel_error, tol, f"model {i} {c.error}" if len(got) > 1 else c.error)
        worst = max(worst, c.max_rel_error)
    return Check(True, worst, tol)


def _named_parameters(m: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: p.detach() for k, p in m.named_parameters()}


def _check_named(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], tol: float) -> Check:
    """Tensor by tensor, naming the worst; each tensor's error is relative to the norm of all of
    them together, not to its own.

    A tensor's own norm can be rounding noise: with a BatchNorm after a Linear, the Linear's
    bias gradient is zero in exact arithmetic, about 1e-8 in float32, and two correct
    summation orders differed by 50% of it (tried: Linear(16, 16), BatchNorm1d, N=2).
    """
    if list(got) != list(expected):
        return Check(False, None, tol, f"the wide module has {sorted(got)}, the joined models {sorted(expected)}")
    scale = math.sqrt(sum(_norm(e) ** 2 for e in expected.values())) or 1.0
    errors = {}
    for name, e in expected.items():
        g = got[name]
        if g.shape != e.shape:
            return Check(False, None, tol, f"{name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}")
        errors[name] = _norm(g - e) / scale
    worst = max(errors, key=errors.get, default=None)
    if worst is not None and not errors[worst] <= tol:  # NaN fails too
        return Check(
            False,
            errors[worst],
            tol,
            f"{worst}: error {errors[worst]:.3g} of the norm of all exceeds tolerance {tol:.3g}",
        )
    return Check(True, errors[worst] if worst else 0.0, tol)


def _norm(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.double()).item()
