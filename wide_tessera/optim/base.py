"""The wide optimizer's machinery, which SGD, Adam, AdamW and Adadelta (optim.optimizers) share.

A hyperparameter sweep trains N copies of a model that differ in their learning rate, weight
decay, momentum or betas. In a wide module every tensor holds all N models (a WideLinear's weight
is [N, out, in]), so torch's parameter groups cannot give the models different settings, and
scaling the gradients does nothing under Adam. A `PerModelOptimizer` reads where each model's part
of every tensor lies (core.layout, the module's `model_slots()`) and steps each part with its own
model's settings:

* a tensor that is one model's own (the loop's modules) is stepped by torch's own optimizer,
  one parameter group per model: exactly N separate torch optimizers, in the implementation
  asked for ('foreach', 'fused', or torch's default for the device);
* a wide tensor is stepped at once by the subclass's update rule (`_update`), with per-model
  numbers (optim.numbers) where torch has one number.

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
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Set, Tuple, Type, Union

import torch
from torch import nn

from ..core.errors import WideTesseraError, unknown
from ..core.layout import Layout, slots_of
from .per_model import models_in, models_reached, parameter_names, per_model, per_model_pairs

__all__ = ["PerModelOptimizer", "IMPLEMENTATIONS"]

# How the N models' own tensors (a loop's) are stepped: torch's default for the device, or one of
# torch's multi-tensor implementations (so are Adam's and AdamW's wide tensors; SGD's are always
# stepped at once, term by term).
IMPLEMENTATIONS = (None, "foreach", "fused")

Check = Callable[[str, Any], Any]


class _Wide:
    """A wide tensor this optimizer steps: its name in one model, and where the models' parts lie."""

    __slots__ = ("name", "tensor", "layout")

    def __init__(self, name: str, tensor: torch.Tensor, layout: Layout):
        self.name, self.tensor, self.layout = name, tensor, layout


class PerModelOptimizer(torch.optim.Optimizer):
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
        self._settings_made: Optional[Tuple[Dict[str, List[float]], Dict[str, torch.Tensor]]] = None
        self._all_active: Optional[torch.Tensor] = None
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
        """1 for each model stepped, 0 for one skipped: what a step adds to the models' step counts
        (where none is skipped, the one tensor of ones, made once: see _settings_per_model)."""
        if not skipped:
            if self._all_active is None:
                self._all_active = torch.ones(self.n, dtype=torch.float64)
            return self._all_active
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
        """Each number of the models' settings as a float64 tensor of N (betas split into beta1 and
        beta2), made again only where a number changed (a schedule's lr). Made at every step, with
        the step-count increment (_active), they were 0.27 ms of the 1.3 ms a step of 16 MLPs of
        hidden 64 spent outside the updates (AdamW, one thread, under cProfile)."""
        numbers: Dict[str, List[float]] = {}
        for k in self.SETTINGS:
            values = [g[k] for g in self.param_groups]
            if k in self.PAIRS:
                for j in range(2):
                    numbers[f"{k[:-1]}{j + 1}"] = [float(v[j]) for v in values]
            else:
                numbers[k] = [float(v) for v in values]
        if self._settings_made is None or self._settings_made[0] != numbers:
            tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in numbers.items()}
            self._settings_made = (numbers, tensors)
        return self._settings_made[1]

    def _init_state(self, state: Dict[str, Any], p: torch.Tensor) -> None:
        state["step"] = torch.zeros(self.n, dtype=torch.float64)
        for k in self.MOMENTS:
            state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _numbers(self, s: Dict[str, torch.Tensor], steps: torch.Tensor) -> Dict[str, Any]:
        """What an update of a wide tensor at these per-model step counts multiplies by, each a
        `Numbers` (computed once a step for all tensors stepped alike)."""
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
