"""N models' optimizers as one, each model with its own settings: SGD, Adam and AdamW over what
fuse() returned, whichever strategy runs it.

A hyperparameter sweep trains N copies of a model that differ in their learning rate, weight
decay, momentum or betas. In a wide module every tensor holds all N models (a WideLinear's weight
is [N, out, in]), so torch's parameter groups cannot give the models different settings, and
scaling the gradients does nothing under Adam. These optimizers read where each model's part of
every tensor lies (core.layout, the module's `model_slots()`) and step each part with its own
model's settings:

* a tensor that is one model's own (the loop's modules) is stepped by torch's own optimizer,
  one parameter group per model: exactly N separate torch optimizers, in the implementation
  asked for ('foreach', 'fused', or torch's default for the device);
* a wide tensor is stepped at once, each setting spread over its model's part: torch's update
  rule, term by term, with per-model numbers where torch has one number. Adam and AdamW asked for
  'foreach' or 'fused' instead call torch's own kernels over the models' parts, one call per set
  of models with equal settings: the fused kernel reads a tensor once where the term-by-term
  rule reads it about eight times (N=32 MLPs of hidden 256 on one CPU core: an optimizer step of
  31 ms term by term, 12 to 14 ms fused; at hidden 64 the N calls cost more than they save, 3.2
  ms against 1.4).

`param_groups[i]` holds model i's settings, so torch's learning-rate schedulers schedule each
model (LambdaLR with a list of N functions gives each its own; wide_tessera.optim's StepLR,
CosineAnnealingLR and LinearLR take per-model arguments). `freeze(i)` stops model i's updates
(a pruned trial) without touching the others. `state_dicts()` gives N optimizer states in
torch's own format (`torch.optim.Adam(model.parameters()).load_state_dict` takes model i's),
and `load_state_dicts` takes them back, so a group of models can be repacked without losing a
moment. When what the module runs changes (a first call of fuse() chose a wide module), the
optimizer rebinds to it at its next step, its state carried over.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
from torch import nn
from torch.optim.adam import adam as torch_adam
from torch.optim.adamw import adamw as torch_adamw

from ..core.errors import WideTesseraError, unknown
from ..core.layout import Layout, slots_of
from .per_model import models_in, models_reached, number, parameter_names, per_model, per_model_pairs

__all__ = ["SGD", "Adam", "AdamW", "Adadelta", "IMPLEMENTATIONS"]

# How the N models' own tensors (a loop's) are stepped: torch's default for the device, or one of
# torch's multi-tensor implementations (so are Adam's and AdamW's wide tensors; SGD's are always
# stepped at once, term by term).
IMPLEMENTATIONS = (None, "foreach", "fused")

Check = Callable[[str, Any], Any]
# A wide tensor's part of one model, its gradient's and its moments' (in that order), and the model's step count
_Parts = List[Tuple[Sequence[Optional[torch.Tensor]], float]]


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise WideTesseraError(f"{name}={value!r}: give True or False")
    return value


class _Wide:
    """A wide tensor this optimizer steps: its name in one model, and where the models' parts lie."""

    __slots__ = ("name", "tensor", "layout")

    def __init__(self, name: str, tensor: torch.Tensor, layout: Layout):
        self.name, self.tensor, self.layout = name, tensor, layout


class _PerModel(torch.optim.Optimizer):
    """The machinery the optimizers share (see the module's docstring). A subclass names torch's
    class (TORCH), its settings and their checks (SETTINGS; a pair where PAIRS), its per-element
    state (MOMENTS), and implements `_update(p, grad, state, layout, numbers)` for a wide tensor."""

    TORCH: ClassVar[Type[torch.optim.Optimizer]]
    SETTINGS: ClassVar[Dict[str, Check]]
    PAIRS: ClassVar[Tuple[str, ...]] = ()
    MOMENTS: ClassVar[Tuple[str, ...]]

    def __init__(self, module: nn.Module, implementation: Optional[str] = None, **settings: Any):
        self.n = models_in(module)
        if implementation not in IMPLEMENTATIONS:
            raise unknown("implementation", implementation, [str(i) for i in IMPLEMENTATIONS])
        other = next((k for k in settings if k not in self.SETTINGS), None)
        if other is not None:  # torch's amsgrad, maximize, ...: a TypeError of Python's said less
            raise WideTesseraError(
                f"wide_tessera.optim.{type(self).__name__}: {other}={settings[other]!r} is not one of its settings "
                f"({', '.join(self.SETTINGS)}; implementation: one of {', '.join(map(str, IMPLEMENTATIONS))})"
            )
        values: Dict[str, List[Any]] = {
            k: (per_model_pairs if k in self.PAIRS else per_model)(k, settings[k], self.n, check)
            for k, check in self.SETTINGS.items()
        }
        groups = [{"params": [], **{k: values[k][i] for k in self.SETTINGS}} for i in range(self.n)]
        for i, group in enumerate(groups):
            self._check_group(i, group)
        # torch's defaults, as its optimizer has them: schedulers read them (OneCycleLR and CyclicLR
        # cycle the momentum, or beta1, of an optimizer whose defaults name it, and refused ours)
        signature = inspect.signature(type(self).__init__).parameters
        super().__init__(groups, {k: signature[k].default for k in self.SETTINGS})
        self.module, self.implementation = module, implementation
        self.frozen: Set[int] = set()
        self._runs: Optional[nn.Module] = None
        self._own: List[List[Tuple[str, torch.Tensor]]] = []
        self._wide: List[_Wide] = []
        self._inner: Optional[torch.optim.Optimizer] = None
        self._bind()

    def _check_group(self, i: int, group: Dict[str, Any]) -> None:
        """Refuse settings that cannot go together for model i (SGD's nesterov without momentum)."""

    # --- what the module runs -------------------------------------------------------------------

    def _bind(self) -> None:
        """Read the module's tensors and where each model's parts lie; again, its state carried
        over, when what the module runs has changed since."""
        runs = getattr(self.module, "runs", self.module)
        if runs is self._runs:
            return
        carried = self.state_dicts() if self._runs is not None else None
        self._runs = runs
        params = dict(self.module.named_parameters())
        own: List[List[Tuple[str, torch.Tensor]]] = [[] for _ in range(self.n)]
        wide: List[_Wide] = []
        seen: Set[int] = set()
        for key, slot in slots_of(self.module).items():
            p = params.get(key)
            if p is None or id(p) in seen:  # a buffer, or a second name of a tied weight
                continue
            seen.add(id(p))
            if slot.layout.model is not None:
                own[slot.layout.model].append((slot.name, p))
            else:
                wide.append(_Wide(slot.name, p, slot.layout))
        self._own, self._wide = own, wide
        self.state.clear()
        self._inner = None
        if any(own):
            implementation: Dict[str, Any] = {} if self.implementation is None else {self.implementation: True}
            groups = [{"params": [p for _, p in own[i]], **self._torch_settings(i)} for i in range(self.n)]
            self._inner = self.TORCH(groups, **implementation)
        if carried is not None:
            self.load_state_dicts(carried)

    def _torch_settings(self, i: int) -> Dict[str, Any]:
        """Model i's settings as torch's optimizer takes them."""
        return {k: self.param_groups[i][k] for k in self.SETTINGS}

    # --- stepping ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._bind()
        if self._inner is not None:
            reached = models_reached(self.module)
            for i, theirs in enumerate(self._inner.param_groups):
                theirs.update(self._torch_settings(i))
                own = [p for _, p in self._own[i] if i not in self._sat_out(p, Layout.own(i), reached)]
                theirs["params"] = [] if i in self.frozen else own
            self._inner.step()
        if self._wide:
            self._step_wide()
        return loss

    def _active(self, skipped: Set[int]) -> torch.Tensor:
        """1 for each model stepped, 0 for one skipped: what a step adds to the models' step counts."""
        return torch.tensor([0.0 if i in skipped else 1.0 for i in range(self.n)], dtype=torch.float64)

    def _step_wide(self) -> None:
        settings = self._settings_per_model()
        numbers: Dict[Tuple[float, ...], Dict[str, Any]] = {}  # per step counts: the numbers of this step
        for w, skipped in self._stepped():
            p, state = w.tensor, self.state[w.tensor]
            kept = self._kept_parts(p, w.layout, state, skipped)
            state["step"] += self._active(skipped)
            steps = tuple(state["step"].tolist())
            if steps not in numbers:
                numbers[steps] = self._numbers(settings, state["step"])
            self._update_wide(p, w.layout, state, numbers[steps])
            for tensor, i, value in kept:
                w.layout.parts(tensor, self.n)[i].copy_(value)  # type: ignore[union-attr]

    def _stepped(self) -> List[Tuple[_Wide, Set[int]]]:
        """The wide tensors this step updates (those with a gradient), their state made where new,
        each with the models whose parts it leaves as they are (frozen, or sat out)."""
        reached = models_reached(self.module)
        wides = []
        for w in self._wide:
            grad = w.tensor.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise WideTesseraError(f"{w.name}: sparse gradients are not supported")
            if not self.state[w.tensor]:
                self._init_state(self.state[w.tensor], w.tensor)
            wides.append((w, self.frozen | self._sat_out(w.tensor, w.layout, reached)))
        return wides

    def _sat_out(self, p: torch.Tensor, layout: Layout, reached: Optional[Set[int]]) -> Set[int]:
        """The models whose part of `p`'s gradient torch would hold as None: none of their outputs
        reached the loss (`reached`, what the module recorded; None: not known), and nothing else
        gave the part a gradient (a penalty on the parameters themselves does, and torch steps it
        then). A model in the loss is stepped whatever its gradient, zeros included, as torch steps it."""
        if reached is None or p.grad is None or len(reached) == self.n:
            return set()
        sizes = layout.norms(p.grad, self.n, math.inf).tolist()  # (NaN: a gradient)
        return {i for i in range(self.n) if i not in reached and sizes[i] == 0}

    def _kept_parts(
        self, p: torch.Tensor, layout: Layout, state: Dict[str, Any], skipped: Set[int]
    ) -> List[Tuple[torch.Tensor, int, torch.Tensor]]:
        """The skipped models' parts of `p` and its moments, copied before an update that steps all
        N at once, to be put back after it (a pruned trial may have NaN gradients: masking its
        update arithmetically would spread them)."""
        kept: List[Tuple[torch.Tensor, int, torch.Tensor]] = []
        for t in [p, *(state[k] for k in self.MOMENTS if state.get(k) is not None)] if skipped else []:
            parts = layout.parts(t, self.n)
            kept += [(t, i, parts[i].clone()) for i in skipped]  # type: ignore[union-attr]
        return kept

    def _settings_per_model(self) -> Dict[str, torch.Tensor]:
        """Each number of the models' settings as a float64 tensor of N (betas split into beta1 and beta2)."""
        out: Dict[str, torch.Tensor] = {}
        for k in self.SETTINGS:
            values = [g[k] for g in self.param_groups]
            if k in self.PAIRS:
                for j in range(2):
                    out[f"{k[:-1]}{j + 1}"] = torch.tensor([float(v[j]) for v in values], dtype=torch.float64)
            else:
                out[k] = torch.tensor([float(v) for v in values], dtype=torch.float64)
        return out

    def _init_state(self, state: Dict[str, Any], p: torch.Tensor) -> None:
        state["step"] = torch.zeros(self.n, dtype=torch.float64)
        for k in self.MOMENTS:
            state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _numbers(self, s: Dict[str, torch.Tensor], steps: torch.Tensor) -> Dict[str, Any]:
        """What an update of a wide tensor at these per-model step counts multiplies by, each a
        `_PerModel` number (computed once a step for all tensors stepped alike)."""
        raise NotImplementedError

    def _update_wide(self, p: torch.Tensor, layout: Layout, state: Dict[str, Any], c: Dict[str, Any]) -> None:
        """`_update` of a wide tensor: at once in 32 or 64 bits; in 16, model by model with each
        one's floats. torch's 16-bit arithmetic is not the same at every position of a tensor
        (`g.add_(p, alpha=0.1)` over four models' bfloat16 parts at once gave values an ulp from
        the same over each part: its vectorised loop and its tail round apart), and numbers held
        as float32 tensors kept intermediates in float32 where torch's Python floats round each to
        16 bits: bfloat16 parts ended an ulp or two apart in five steps, float16 ones finite where
        torch's divided by an eps that is 0 in 16 bits."""
        assert p.grad is not None
        if p.element_size() >= 4:
            self._update(p, p.grad, state, layout, c)
            return
        n = self.n
        shaped = {k: layout.parts(t, n) for k, t in state.items() if isinstance(t, torch.Tensor) and t.shape == p.shape}
        for i, (mine, grad) in enumerate(zip(layout.parts(p, n), layout.parts(p.grad, n))):
            if mine is None:  # the tensor is another model's alone
                continue
            # each part as torch steps a model's own tensor, contiguous: a channels_last part's
            # bfloat16 add_ rounded apart from a contiguous one's
            parts = {"p": mine, "g": grad, **{k: t[i] for k, t in shaped.items()}}
            work = {k: t.contiguous() for k, t in parts.items()}  # type: ignore[union-attr]
            numbers = {k: x and x.model(i) for k, x in c.items()}
            moments = {k: work[k] for k in shaped}
            self._update(work["p"], work["g"], {**state, **moments}, layout, numbers)
            for k in ("p", *shaped):
                if work[k] is not parts[k]:
                    parts[k].copy_(work[k])  # type: ignore[union-attr]

    def _update(
        self, p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], layout: Layout, c: Dict[str, Any]
    ) -> None:
        """One step of tensor `p` (or a model's part of it, numbers all floats), gradient `g`."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    # --- models -----------------------------------------------------------------------------------

    def freeze(self, models: Union[int, Iterable[int]]) -> None:
        """Stop stepping these models (their parameters and optimizer state stay as they are)."""
        self.frozen |= set(self._indices(models))

    def unfreeze(self, models: Union[int, Iterable[int]]) -> None:
        self.frozen -= set(self._indices(models))

    def _indices(self, models: Union[int, Iterable[int]]) -> List[int]:
        if not isinstance(models, (int, list, tuple, set, frozenset, range)):
            raise WideTesseraError(f"models={models!r}: give a model index from 0 to {self.n - 1}, or a list of them")
        indices: List[Any] = [models] if isinstance(models, int) else list(models)
        for i in indices:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n:
                raise WideTesseraError(f"model {i!r}: give model indices from 0 to {self.n - 1}")
        return [int(i) for i in indices]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "module", None) is not None:  # torch's __init__ adds the N models' groups
            raise WideTesseraError(f"{type(self).__name__} steps the N models it was made over; it takes no new group")
        super().add_param_group(param_group)

    # --- state: N torch optimizers' --------------------------------------------------------------

    def _names(self) -> List[str]:
        """One model's parameter names, in the order a torch optimizer over it indexes them."""
        names = parameter_names(self.module)
        if names is not None:
            return names
        bound = [w.name for w in self._wide] + [name for model in self._own[:1] for name, _ in model]
        return list(dict.fromkeys(bound))

    def state_dicts(self) -> List[Dict[str, Any]]:
        """Each model's optimizer state as `torch.optim.<class>(model.parameters()).state_dict()`
        gives it: its settings (its learning rate as scheduled now) and its parameters' state."""
        index = {name: i for i, name in enumerate(self._names())}
        states: List[Dict[int, Dict[str, Any]]] = [{} for _ in range(self.n)]
        if self._inner is not None:
            for i, model in enumerate(self._own):
                for name, p in model:
                    if self._inner.state.get(p):
                        states[i][index[name]] = {k: _copy(v) for k, v in self._inner.state[p].items()}
        for w in self._wide:
            state = self.state.get(w.tensor)
            if not state:
                continue
            parts = {k: w.layout.parts(state[k], self.n) for k in self.MOMENTS if state.get(k) is not None}
            for i in range(self.n):
                if state["step"][i] > 0:
                    states[i][index[w.name]] = self._torch_state(i, state, {k: v[i] for k, v in parts.items()})
        return [
            {"state": states[i], "param_groups": [{**_plain(group), "params": list(range(len(index)))}]}
            for i, group in enumerate(self.param_groups)
        ]

    def _torch_state(self, i: int, state: Dict[str, Any], parts: Dict[str, Any]) -> Dict[str, Any]:
        """Model i's state of one wide tensor in torch's format."""
        return {"step": torch.tensor(float(state["step"][i])), **{k: v.clone() for k, v in parts.items()}}

    def load_state_dicts(self, states: List[Dict[str, Any]]) -> None:
        """Take N models' optimizer states (state_dicts' format, torch's): settings and moments."""
        names = self._names()
        self._check_states(states, names)
        for i, state in enumerate(states):
            group = state["param_groups"][0]
            self.param_groups[i].update({k: group[k] for k in group if k != "params"})
        if self._inner is not None:
            index = {name: j for j, name in enumerate(names)}
            for i, model in enumerate(self._own):
                self._inner.state.update({p: _copy(states[i]["state"][index[n]]) for n, p in model
                                          if index[n] in states[i]["state"]})  # fmt: skip
        for w in self._wide:
            j = names.index(w.name)
            per_model = [s["state"].get(j) for s in states]
            if not any(per_model):
                continue
            state = self.state[w.tensor]
            self._init_state(state, w.tensor)
            for i, one in enumerate(per_model):
                if one:
                    self._load_part(i, state, one, w.layout)

    def _check_states(self, states: Any, names: List[str]) -> None:
        """Refuse, before anything is loaded, states this optimizer cannot take: another optimizer's
        (Adam took SGD's and stepped on), or a moment of another shape than its parameter (taken,
        then step() failed on a size mismatch)."""
        if not isinstance(states, (list, tuple)) or len(states) != self.n:
            raise WideTesseraError(f"load_state_dicts: give {self.n} optimizer states, one per model")
        mine, kept = type(self).__name__, {"step", *self.MOMENTS}
        for i, state in enumerate(states):
            groups = state.get("param_groups") if isinstance(state, dict) else None
            if not (isinstance(groups, list) and groups and isinstance(state.get("state"), dict)):
                raise WideTesseraError(f"load_state_dicts: state {i} is not an optimizer's state_dict")
            missing = [k for k in self.SETTINGS if k not in groups[0]]
            if missing:
                raise WideTesseraError(f"load_state_dicts: state {i} has no {', '.join(missing)}: it is not {mine}'s")
            shapes = {w.name: w.layout.parts(w.tensor, self.n)[i].shape for w in self._wide}  # type: ignore[union-attr]
            shapes.update((name, p.shape) for name, p in self._own[i])
            for j, one in state["state"].items():
                other = sorted(k for k in one if k not in kept)
                if other:
                    raise WideTesseraError(
                        f"load_state_dicts: state {i} holds {', '.join(other)}, which {mine} does not keep "
                        f"({', '.join(sorted(kept))}): it is another optimizer's"
                    )
                if not (isinstance(j, int) and 0 <= j < len(names)):
                    raise WideTesseraError(f"load_state_dicts: state {i} holds parameter {j!r} of {len(names)}")
                for k in self.MOMENTS:
                    value = one.get(k)
                    if value is not None and tuple(value.shape) != tuple(shapes[names[j]]):
                        raise WideTesseraError(
                            f"load_state_dicts: state {i}'s {k} of {names[j]} has shape {list(value.shape)}, the "
                            f"parameter {list(shapes[names[j]])}"
                        )

    def _load_part(self, i: int, state: Dict[str, Any], one: Dict[str, Any], layout: Layout) -> None:
        state["step"][i] = float(one.get("step", 1))
        for k in self.MOMENTS:
            if one.get(k) is not None:
                layout.parts(state[k], self.n)[i].copy_(one[k])  # type: ignore[union-attr]

    def state_dict(self) -> Dict[str, Any]:
        """The N models' optimizer states (`state_dicts`), for a checkpoint of the whole group."""
        return {"models": self.state_dicts()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "models" not in state_dict:
            raise WideTesseraError(f"{type(self).__name__}.load_state_dict takes what its state_dict() gave")
        self.load_state_dicts(state_dict["models"])


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _plain(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class _Numbers:
    """One number per model for a step of the wide tensors: a Python float where the N agree (then
    torch's own arithmetic, scalar for scalar), else the N spread over each model's part of a
    tensor, in at least float32 (a learning rate of 1e-3 in bfloat16 is 0.000999), converted once
    a step per device and dtype."""

    def __init__(self, values: torch.Tensor):
        self.values = values
        first = float(values[0])
        self.same: Optional[float] = first if bool((values == first).all()) else None
        self._on: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def over(self, layout: Layout, p: torch.Tensor) -> Union[float, torch.Tensor]:
        if self.same is not None:
            return self.same
        key = (p.device, torch.promote_types(p.dtype, torch.float32))
        if key not in self._on:
            self._on[key] = self.values.to(device=key[0], dtype=key[1])
        return layout.spread(self._on[key], p)

    def add_to(self, target: torch.Tensor, other: torch.Tensor, layout: Layout, sign: float = 1.0) -> torch.Tensor:
        """target += sign * number * other, as torch's `target.add_(other, alpha=...)` computes it
        (on a CPU a fused multiply-add, one rounding: a product then a sum ended a few elements an
        ulp away each step, which 200 steps of a sweep turned into 2% of a final loss), model by
        model where the numbers differ. Returns target."""
        if self.same is not None:
            return target.add_(other, alpha=sign * self.same)
        n = self.values.numel()
        for mine, theirs, value in zip(layout.parts(target, n), layout.parts(other, n), self.values.tolist()):
            mine.add_(theirs, alpha=sign * value)  # type: ignore[union-attr, arg-type]
        return target

    def model(self, i: int) -> "_Numbers":
        """Model i's number alone."""
        return _Numbers(self.values[i : i + 1])

    def addcdiv_to(self, target: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, layout: Layout) -> None:
        """target -= number * t1 / t2, model by model: torch's `addcdiv_(t1, t2, value=-number)`."""
        n = self.values.numel()
        parts = zip(layout.parts(target, n), layout.parts(t1, n), layout.parts(t2, n), self.values.tolist())
        for mine, a, b, value in parts:
            mine.addcdiv_(a, b, value=-value)  # type: ignore[union-attr, arg-type]


def _mul_addcmul(
    t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, keep: _Numbers, rest: _Numbers, layout: Layout
) -> None:
    """t = t * keep + rest * a * b, as torch's `t.mul_(keep).addcmul_(a, b, value=rest)` computes it
    (a running average of squares: Adam's, Adadelta's); where `rest` differs per model, in
    addcmul's order, rest * a * b."""
    value = rest.over(layout, t)
    if isinstance(value, float):
        t.mul_(keep.over(layout, t)).addcmul_(a, b, value=value)
    else:
        t.mul_(keep.over(layout, t)).addcmul_(a * value, b)


# Elements of one model's part from which an update runs model by model rather than over the wide
# tensor with a per-model factor: the factor's temporary costs a pass over memory, N calls cost
# their overhead. One core: a per-model addcdiv_ took 0.27 ms against 0.40 ms at [8, 256, 256],
# 0.35 against 0.40 at [32, 128, 128], 0.15 against 0.07 at [32, 64, 64].
# A fact of this machine, and of N, that no machine fact read at run time gives yet:
# scripts/large_part.py (one thread, 2-core EPYC with 1 MiB of L2 a core, at a load of 6) put the
# crossing between 65536 and 262144 elements a part at N=2, near 32768 at N=8, between 16384 and
# 32768 at N=32; the wide tensor's size against L2 does not give it either: at the same 2 MiB
# wide tensor the wide form took 2.05x the per-model form's time at N=8, and 0.70x at N=32.
# On a GPU, where N calls are N launches of several microseconds, the wide form should win far
# beyond it; not measured there.
_LARGE_PART = 16384


class SGD(_PerModel):
    """torch.optim.SGD for each of the N models: lr, momentum, dampening, weight_decay and nesterov,
    each one value or one per model."""

    TORCH: ClassVar[Type[torch.optim.Optimizer]] = torch.optim.SGD
    SETTINGS = {
        "lr": number(0.0),
        "momentum": number(0.0),
        "dampening": number(0.0),
        "weight_decay": number(0.0),
        "nesterov": _flag,
    }
    MOMENTS = ("momentum_buffer",)

    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        momentum: Any = 0.0,
        dampening: Any = 0.0,
        weight_decay: Any = 0.0,
        nesterov: Any = False,
        implementation: Optional[str] = None,
        **others: Any,
    ):
        super().__init__(
            module, implementation, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, **others,
        )  # fmt: skip

    def _check_group(self, i: int, group: Dict[str, Any]) -> None:
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise WideTesseraError(f"model {i}: nesterov momentum needs momentum > 0 and dampening 0")

    def _numbers(self, s: Dict[str, torch.Tensor], steps: torch.Tensor) -> Dict[str, Any]:
        # torch: the first step's buffer is the gradient itself; later, momentum * buf + (1 - dampening) * grad;
        # a model without momentum has none, its step the gradient (here: a buffer equal to it)
        fresh = (steps == 1) | (s["momentum"] == 0)
        return {
            "decay": _Numbers(s["weight_decay"]) if s["weight_decay"].any() else None,
            "keep": _Numbers(torch.where(fresh, 0.0, s["momentum"])) if s["momentum"].any() else None,
            "scale": _Numbers(torch.where(fresh, 1.0, 1.0 - s["dampening"])),
            "nesterov": _Numbers(s["nesterov"]) if s["nesterov"].any() else None,
            "momentum": _Numbers(s["momentum"]),
            "lr": _Numbers(s["lr"]),
        }

    def _update(
        self, p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], layout: Layout, c: Dict[str, Any]
    ) -> None:
        if c["decay"] is not None:  # torch: grad.add(param, alpha=weight_decay)
            g = c["decay"].add_to(g.clone(), p, layout)
        if c["keep"] is not None:  # torch: buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            buf = state["momentum_buffer"]
            c["scale"].add_to(buf.mul_(c["keep"].over(layout, p)), g, layout)
            if c["nesterov"] is None:
                g = buf
            else:  # torch: grad.add(buf, alpha=momentum)
                nesterov = c["nesterov"].over(layout, p)
                ahead = c["momentum"].add_to(g.clone(), buf, layout)
                if isinstance(nesterov, float):
                    g = ahead if nesterov else buf
                else:
                    g = torch.where(nesterov > 0, ahead, buf)
        c["lr"].add_to(p, g, layout, sign=-1.0)  # torch: param.add_(grad, alpha=-lr)

    def _init_state(self, state: Dict[str, Any], p: torch.Tensor) -> None:
        state["step"] = torch.zeros(self.n, dtype=torch.float64)
        momentum = any(g["momentum"] > 0 for g in self.param_groups)
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format) if momentum else None

    def _torch_state(self, i: int, state: Dict[str, Any], parts: Dict[str, Any]) -> Dict[str, Any]:
        """torch's SGD keeps a momentum buffer only where there is momentum, and no step count."""
        buf = parts.get("momentum_buffer")
        return {"momentum_buffer": buf.clone() if buf is not None and self.param_groups[i]["momentum"] > 0 else None}

    def _load_part(self, i: int, state: Dict[str, Any], one: Dict[str, Any], layout: Layout) -> None:
        state["step"][i] = 1.0  # torch's SGD counts no steps: it has stepped, so its buffer is not fresh
        if one.get("momentum_buffer") is not None and state["momentum_buffer"] is not None:
            layout.parts(state["momentum_buffer"], self.n)[i].copy_(one["momentum_buffer"])  # type: ignore[union-attr]


class Adam(_PerModel):
    """torch.optim.Adam for each of the N models: lr, betas, eps, weight_decay (added to the
    gradient) and amsgrad, each one value or one per model (betas: one pair, each coefficient one
    value or N, or N pairs)."""

    TORCH: ClassVar[Type[torch.optim.Optimizer]] = torch.optim.Adam
    SETTINGS = {
        "lr": number(0.0),
        "betas": number(0.0, 1.0, open_high=True),  # each coefficient's, the pair per_model_pairs's
        "eps": number(0.0),
        "weight_decay": number(0.0),
        "amsgrad": _flag,
    }
    PAIRS = ("betas",)
    MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    DECOUPLED = False
    TORCH_STEP: ClassVar[Callable[..., None]] = staticmethod(torch_adam)

    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        betas: Any = (0.9, 0.999),
        eps: Any = 1e-8,
        weight_decay: Any = 0.0,
        amsgrad: Any = False,
        implementation: Optional[str] = None,
        **others: Any,
    ):
        super().__init__(
            module, implementation, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **others
        )

    def _init_state(self, state: Dict[str, Any], p: torch.Tensor) -> None:
        """torch's Adam keeps the largest second moment only where amsgrad is on."""
        super()._init_state(state, p)
        if not any(g["amsgrad"] for g in self.param_groups):
            state["max_exp_avg_sq"] = None

    def _torch_state(self, i: int, state: Dict[str, Any], parts: Dict[str, Any]) -> Dict[str, Any]:
        own = super()._torch_state(i, state, parts)
        if not self.param_groups[i]["amsgrad"]:
            own.pop("max_exp_avg_sq", None)
        return own

    def _numbers(self, s: Dict[str, torch.Tensor], steps: torch.Tensor) -> Dict[str, Any]:
        steps = steps.clamp(min=1.0)  # a frozen model's 0 steps would divide by zero; its part is restored
        bias1, bias2 = 1 - s["beta1"] ** steps, 1 - s["beta2"] ** steps
        decay = (1 - s["lr"] * s["weight_decay"]) if self.DECOUPLED else s["weight_decay"]
        return {
            "decay": _Numbers(decay) if s["weight_decay"].any() else None,
            "beta1": _Numbers(1 - s["beta1"]),
            "beta2": _Numbers(s["beta2"]),
            "beta2_rest": _Numbers(1 - s["beta2"]),
            "bias2_sqrt": _Numbers(bias2.sqrt()),
            "eps": _Numbers(s["eps"]),
            "step_size": _Numbers(s["lr"] / bias1),
            "amsgrad": _Numbers(s["amsgrad"]) if s["amsgrad"].any() else None,
        }

    def _update(
        self, p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], layout: Layout, c: Dict[str, Any]
    ) -> None:
        """torch's single-tensor Adam, line by line, with each model's numbers over its part."""
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # torch skips a weight_decay of 0 (in float16, 0 * an inf parameter would be NaN)
        if c["decay"] is not None and c["decay"].same != (1.0 if self.DECOUPLED else 0.0):
            decay = c["decay"].over(layout, p)
            if self.DECOUPLED:  # torch: param.mul_(1 - lr * weight_decay)
                p.mul_(decay)
            else:  # torch: grad.add(param, alpha=weight_decay)
                g = c["decay"].add_to(g.clone(), p, layout)
        m.lerp_(g, c["beta1"].over(layout, p))  # torch: exp_avg.lerp_(grad, 1 - beta1)
        _mul_addcmul(v, g, g, c["beta2"], c["beta2_rest"], layout)  # torch: exp_avg_sq's, by beta2
        amsgrad = c["amsgrad"].over(layout, p) if c["amsgrad"] is not None else 0.0
        if not isinstance(amsgrad, float) or amsgrad:  # torch: torch.maximum(max_exp_avg_sq, exp_avg_sq, out=...)
            top = state["max_exp_avg_sq"]
            torch.maximum(top, v, out=top)
            v = top if isinstance(amsgrad, float) else torch.where(amsgrad > 0, top, v)  # the denominator's
        denom = (v.sqrt() / c["bias2_sqrt"].over(layout, p)).add_(c["eps"].over(layout, p))
        step_size = c["step_size"].over(layout, p)
        if isinstance(step_size, float):  # torch: param.addcdiv_(exp_avg, denom, value=-step_size)
            p.addcdiv_(m, denom, value=-step_size)
        elif p.numel() >= _LARGE_PART * self.n:  # torch's addcdiv_ on each model's part: one pass, no temporary
            c["step_size"].addcdiv_to(p, m, denom, layout)
        else:  # in addcdiv's order, value * exp_avg / denom: the same rounding, bit for bit
            p.addcdiv_(torch.mul(m, step_size), denom, value=-1.0)

    def _step_wide(self) -> None:
        if self.implementation is None:
            super()._step_wide()
            return
        alike: Dict[str, List[int]] = {}  # the models of equal settings, stepped by one call
        for i, group in enumerate(self.param_groups):
            if i not in self.frozen:
                alike.setdefault(repr([group[k] for k in self.SETTINGS]), []).append(i)
        # each model's parts of every wide tensor (the tensor, its gradient, its moments) and its step count
        parts: List[_Parts] = [[] for _ in range(self.n)]
        for w, skipped in self._stepped():
            state = self.state[w.tensor]
            counts = state["step"].tolist()
            state["step"] += self._active(skipped)  # torch's kernel counts its own copy of the count, below
            tensors = [w.tensor, w.tensor.grad, *(state[k] for k in self.MOMENTS if state[k] is not None)]
            for i, four in enumerate(zip(*(w.layout.parts(t, self.n) for t in tensors))):
                if i not in skipped:
                    parts[i].append((four, counts[i]))
        for models in alike.values():
            stepped = [one for i in models for one in parts[i]]
            if stepped:
                self._step_by_torch(stepped, self.param_groups[models[0]])

    def _step_by_torch(self, parts: _Parts, group: Dict[str, Any]) -> None:
        """Models of equal settings (`group`) stepped by torch's own Adam in the implementation asked
        for, over their parts of every wide tensor: what their torch optimizers do, kernel for
        kernel. The fused kernel reads a non-contiguous view as if it were contiguous (a joined
        part along an inner axis came out wrong): such a part is stepped as a contiguous copy."""
        fused = self.implementation == "fused"
        lists: List[List[torch.Tensor]] = [[], [], [], [], []]
        steps: List[torch.Tensor] = []
        back: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for four, count in parts:
            for into, part in zip(lists, four):
                assert part is not None
                if fused and not part.is_contiguous():
                    back.append((part, part.contiguous()))
                    part = back[-1][1]
                into.append(part)
            device = lists[0][-1].device if fused else torch.device("cpu")  # where torch's Adam keeps its count
            steps.append(torch.tensor(count, dtype=torch.float32, device=device))
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        self.TORCH_STEP(
            *lists[:4], lists[4] if amsgrad else [], steps, foreach=not fused, fused=fused, amsgrad=amsgrad,
            beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip
        for part, stepped in back:
            part.copy_(stepped)


class AdamW(Adam):
    """torch.optim.AdamW for each of the N models: Adam with its weight decay applied to the
    parameters (decoupled), default 0.01 as torch's."""

    TORCH = torch.optim.AdamW
    DECOUPLED = True
    TORCH_STEP = staticmethod(torch_adamw)

    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        betas: Any = (0.9, 0.999),
        eps: Any = 1e-8,
        weight_decay: Any = 1e-2,
        amsgrad: Any = False,
        implementation: Optional[str] = None,
        **others: Any,
    ):
        super().__init__(module, lr, betas, eps, weight_decay, amsgrad, implementation, **others)


class Adadelta(_PerModel):
    """torch.optim.Adadelta for each of the N models: lr, rho, eps and weight_decay, each one value
    or one per model (HFTA's third fused optimizer)."""

    TORCH: ClassVar[Type[torch.optim.Optimizer]] = torch.optim.Adadelta
    SETTINGS = {"lr": number(0.0), "rho": number(0.0, 1.0), "eps": number(0.0), "weight_decay": number(0.0)}
    MOMENTS = ("square_avg", "acc_delta")

    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1.0,
        rho: Any = 0.9,
        eps: Any = 1e-6,
        weight_decay: Any = 0.0,
        implementation: Optional[str] = None,
        **others: Any,
    ):
        super().__init__(module, implementation, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, **others)

    def _numbers(self, s: Dict[str, torch.Tensor], steps: torch.Tensor) -> Dict[str, Any]:
        return {
            "decay": _Numbers(s["weight_decay"]) if s["weight_decay"].any() else None,
            "rho": _Numbers(s["rho"]),
            "rho_rest": _Numbers(1 - s["rho"]),
            "eps": _Numbers(s["eps"]),
            "lr": _Numbers(s["lr"]),
        }

    def _update(
        self, p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], layout: Layout, c: Dict[str, Any]
    ) -> None:
        """torch's single-tensor Adadelta, line by line, with each model's numbers over its part."""
        if c["decay"] is not None:  # torch: grad.add(param, alpha=weight_decay)
            g = c["decay"].add_to(g.clone(), p, layout)
        square, accumulated = state["square_avg"], state["acc_delta"]
        _mul_addcmul(square, g, g, c["rho"], c["rho_rest"], layout)  # torch: square_avg's, by rho
        eps = c["eps"].over(layout, p)
        std = square.add(eps).sqrt_()
        delta = accumulated.add(eps).sqrt_().div_(std).mul_(g)
        _mul_addcmul(accumulated, delta, delta, c["rho"], c["rho_rest"], layout)  # torch: acc_delta's
        c["lr"].add_to(p, delta, layout, sign=-1.0)  # torch: param.add_(delta, alpha=-lr)
