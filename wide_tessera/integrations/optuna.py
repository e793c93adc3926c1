"""Optuna studies whose trials train fused: each group of trials whose models share a shape trains
as one wide model (`fuse()` and `wide_tessera.optim`), each trial with its own settings, its
intermediate values reported to Optuna and pruned one by one.

    import optuna
    from wide_tessera.integrations.optuna import Training, optimize

    def suggest(trial):
        return {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
                "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1)}

    training = Training(steps=200, batch=lambda params, step: data[step], loss=F.mse_loss, optimizer="adamw")
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
    summary = optimize(study, suggest, lambda params: MLP(), training, n_trials=16)
    print(summary)

A hyperparameter sweep of a small model leaves a machine idle one trial at a time; its trials
differ in numbers (learning rate, weight decay, betas, seed) that change no shape. HFTA (MLSys'21)
trained such trials as one fused model with its own driver; this runs them under the study you
already have, through Optuna's ask-and-tell, so its storage, dashboard and trials_dataframe()
work as usual.

* **Groups.** Trials are asked one at a time; a trial joins the trials waiting whose models have
  its shape (every parameter's and buffer's name, shape and dtype, and every setting a module
  keeps: a dropout rate). A group trains when it has `group_size` trials (or when no trial is
  left to ask). The summary says which suggested parameters told groups apart.
* **Group size.** The user's number, or the measurement's: the largest N at which this
  machine's dispatch table says the model's training step fuses (`--mode train` entries: a
  `tune` run's, or measured here by `benchmark_custom(mode='train')` and written to the table
  for the next study), capped by memory. The summary says which size and why.
* **Pruning.** A trial Optuna's pruner stops is frozen at once (`opt.freeze`); the group is then
  repacked without it (its survivors' weights, optimizer states and schedule carried over
  exactly), so a pruned trial stops costing time.
* **Same answer.** Each trial's model is built under `torch.manual_seed(params.get('seed',
  trial.number))`, and `sequential_objective` trains one trial alone with torch's own optimizer,
  clipping and schedule: the baseline a fused study is compared with, per step.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import psutil
import torch
from torch import nn
from tqdm.auto import tqdm

from .. import optim
from ..api import benchmark_custom
from ..core import trees
from ..core.errors import MissingDependency, WideTesseraError, unknown
from ..dispatch.build import Fused
from ..dispatch.fuse import decide_at, fuse
from ..dispatch.table import default_table_path, merge_into
from ..measurement.settings import resolve_device
from ..measurement.timing import TimingConfig
from ..ops.base import layout_of

try:
    import optuna
except ImportError:  # pragma: no cover  the extra is not installed: optimize() says so
    optuna = None

__all__ = ["Training", "optimize", "sequential_objective", "StudySummary", "GroupRecord", "trial_seed"]

OPTIMIZERS: Dict[str, Tuple[Any, Any]] = {
    "sgd": (torch.optim.SGD, optim.SGD),
    "adam": (torch.optim.Adam, optim.Adam),
    "adamw": (torch.optim.AdamW, optim.AdamW),
}
# the suggested parameters each optimizer takes by name (betas as a pair, or beta1 and beta2)
_SETTINGS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
}
# the group sizes a measurement tries, at most
_MEASURED_NS = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Training:
    """How one trial's model trains: what a sequential objective's loop does, for one model.

    steps: training steps. batch(params, step) -> (input, target) of one trial at a step (an
    input: a tensor, a tuple of positional or a dict of keyword arguments). loss(output, target)
    -> the trial's loss. optimizer: 'sgd', 'adam' or 'adamw', its settings taken from the trial's
    parameters by name (lr, momentum, dampening, weight_decay, nesterov, betas or beta1/beta2,
    eps), torch's defaults for the rest. clip: each trial's gradient norm limit (None: none).
    cosine: the learning rate follows a cosine to 0 over `steps`. report_every: how often the
    mean loss of the last steps is reported to Optuna (and its pruner asked). evaluate(model,
    params) -> the value told to Optuna at the end (default: the last reported mean loss).
    """

    steps: int
    batch: Callable[[Dict[str, Any], int], Tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: str = "adam"
    clip: Optional[float] = None
    cosine: bool = False
    report_every: int = 10
    evaluate: Optional[Callable[[nn.Module, Dict[str, Any]], float]] = None

    def __post_init__(self) -> None:
        for name in ("steps", "report_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WideTesseraError(f"Training: {name}={value!r}: give a positive int")
        if self.optimizer not in OPTIMIZERS:
            raise unknown("optimizer", self.optimizer, OPTIMIZERS)
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise WideTesseraError(f"Training: clip={self.clip!r}: give a positive number, or None")
        for name in ("batch", "loss"):
            if not callable(getattr(self, name)):  # (a list of tensors was printed whole)
                raise WideTesseraError(f"Training: {name} is a {type(getattr(self, name)).__name__}, not a function")
        if self.evaluate is not None and not callable(self.evaluate):
            raise WideTesseraError(f"Training: evaluate={self.evaluate!r} is not callable")

    def reports_at(self, step: int) -> bool:
        """Whether a trial reports after `step`: every `report_every`-th step, and the last."""
        return (step + 1) % self.report_every == 0 or step + 1 == self.steps

    def reported(self, losses: List[float]) -> float:
        """What a trial reports: the mean of its last `report_every` losses."""
        recent = losses[-self.report_every :]
        return sum(recent) / len(recent)

    def settings(self, params: Dict[str, Any]) -> Dict[str, Any]:
        """The optimizer's settings in a trial's parameters."""
        found = {k: params[k] for k in _SETTINGS[self.optimizer] if k in params}
        if "betas" in _SETTINGS[self.optimizer] and ("beta1" in params or "beta2" in params):
            found["betas"] = (params.get("beta1", 0.9), params.get("beta2", 0.999))
        return found


def trial_seed(trial: Any, params: Dict[str, Any]) -> int:
    """The seed a trial's model is built under: its 'seed' parameter, else its number."""
    seed = params.get("seed", trial.number)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**63:
        raise WideTesseraError(f"trial {trial.number}: seed={seed!r}: give an int from 0 to 2**63 - 1")
    return int(seed)


def _forked(device: str) -> Any:
    """The block's random draws on a fork of the generators `device` draws from: the caller's are
    left as they were."""
    where = torch.device(device)
    return torch.random.fork_rng(devices=[where.index or 0] if where.type == "cuda" else [])


@contextmanager
def _seeded(device: str, seed: int) -> Iterator[None]:
    """Random draws (a model's initial weights, dropout's masks) from `seed`, the caller's generator
    left as it was: a trial's model, and its training, are the same whatever ran before them, so a
    study of a seeded sampler gives the same values run after run."""
    with _forked(device):
        torch.manual_seed(seed)
        yield


class _Draws:
    """A trial's random numbers, each stream seeded from the trial's seed and kept apart from the
    others and from the caller's generator: its model's initial weights (drawn under the seed
    itself), its batches (`batch(params, step)` drawing random data or indices), and its
    training's (dropout's masks). A trial then gets the same weights and batches alone and in a
    group, whatever its group mates draw: with one stream for the group, each trial's random
    batches were other data than alone, and final values up to 71% apart."""

    def __init__(self, seed: int, device: str):
        self.where = torch.device(device)
        seeds = torch.randint(2**62, (2,), generator=torch.Generator().manual_seed(seed))
        data_seed, self.training_seed = seeds.tolist()
        with _forked(device):
            torch.manual_seed(data_seed)
            self._data = self._state()

    def _state(self) -> List[torch.Tensor]:
        cuda = [torch.cuda.get_rng_state(self.where)] if self.where.type == "cuda" else []
        return [torch.get_rng_state(), *cuda]

    def batch(self, training: Training, params: Dict[str, Any], step: int, keep: bool = True) -> Tuple[Any, Any]:
        """training.batch(params, step) drawn from the trial's data stream (`keep`: the stream moves
        on; False: a look that leaves it where it was, for sizing and timing)."""
        with _forked(str(self.where)):
            torch.set_rng_state(self._data[0])
            if self.where.type == "cuda":
                torch.cuda.set_rng_state(self._data[1], self.where)
            drawn = training.batch(params, step)
            if keep:
                self._data = self._state()
        return drawn


def _build(build: Callable[[Dict[str, Any]], nn.Module], trial: Any, params: Dict[str, Any], device: str) -> nn.Module:
    with _seeded(device, trial_seed(trial, params)):
        model = build(params)
    if not isinstance(model, nn.Module):
        raise WideTesseraError(f"build(params) returned {type(model).__name__}, not an nn.Module")
    return model


def sequential_objective(
    suggest: Callable[[Any], Dict[str, Any]],
    build: Callable[[Dict[str, Any]], nn.Module],
    training: Training,
    device: str = "cpu",
) -> Callable[[Any], float]:
    """An Optuna objective that trains one trial alone, with torch's own optimizer, clipping and
    schedule, reporting and pruning as `optimize` does: the sequential study a fused one is
    compared with (`study.optimize(sequential_objective(...), n_trials=16)`)."""

    def objective(trial: Any) -> float:
        params = _suggested(suggest, trial)
        model = _build(build, trial, params, device).to(device)
        draws = _Draws(trial_seed(trial, params), device)
        with _seeded(device, draws.training_seed):  # its dropout masks
            return _train_alone(trial, params, model, draws, training, device)

    return objective


def _train_alone(
    trial: Any, params: Dict[str, Any], model: nn.Module, draws: "_Draws", training: Training, device: str,
    tick: Callable[[], None] = lambda: None,
) -> float:  # fmt: skip
    """One trial trained alone with torch's own optimizer, clipping and schedule, reporting each
    mean loss and raising optuna.TrialPruned where the pruner says so: the sequential loop's
    training, and a group of one's (`tick`: after each step, for a progress bar)."""
    model.train()
    opt = OPTIMIZERS[training.optimizer][0](model.parameters(), **training.settings(params))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=training.steps) if training.cosine else None
    losses: List[float] = []
    value = math.nan
    for step in range(training.steps):
        x, y = _on(device, draws.batch(training, params, step))
        loss = _loss(training, trees.call(model, x), y)
        loss.backward()
        if training.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.clip)
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
        losses.append(float(loss.detach()))
        tick()
        if training.reports_at(step):
            value = training.reported(losses)
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
    return training.evaluate(model, params) if training.evaluate is not None else value


@dataclass
class GroupRecord:
    """One group of trials trained as one: their numbers, N, what ran, for how long, and why."""

    trials: List[int]
    shape: str
    strategy: Optional[str]
    why: str
    seconds: float
    pruned: List[int] = field(default_factory=list)
    repacked: List[int] = field(default_factory=list)  # the group's N after each repack


@dataclass
class StudySummary:
    """What `optimize` did: the group size and why, per shape; every group; the wall time against
    an estimate of the sequential study (one trial's step timed alone, times every trial's steps),
    and how much of it went to sizing the groups (measuring what the table lacked: a cost the
    next study on this machine, reading the table, does not pay)."""

    sizes: Dict[str, str]
    groups: List[GroupRecord]
    seconds: float
    sequential_estimate_s: float
    shape_params: List[str]
    sizing_s: float = 0.0
    pruned_by_suggest: int = 0  # trials whose suggest raised TrialPruned: asked, never trained

    def __str__(self) -> str:
        fused = sum(g.strategy is not None for g in self.groups)
        trained, pruned = sum(len(g.trials) for g in self.groups), sum(len(g.pruned) for g in self.groups)
        by_suggest = f" ({self.pruned_by_suggest} by suggest)" if self.pruned_by_suggest else ""
        lines = [
            f"{trained + self.pruned_by_suggest} trials, {trained} in {len(self.groups)} group(s), {fused} of them "
            f"fused, {pruned + self.pruned_by_suggest} pruned{by_suggest}; {self.seconds:.1f} s "
            f"(sequential, unpruned, estimated {self.sequential_estimate_s:.1f} s)"
        ]
        if self.sizing_s >= 0.05:
            lines.append(f"of which {self.sizing_s:.1f} s measured what the table lacked (once: later studies read it)")
        if self.shape_params:
            lines.append(f"groups told apart by: {', '.join(self.shape_params)}")
        lines += [f"group size for {shape}: {why}" for shape, why in self.sizes.items()]
        for i, g in enumerate(self.groups):
            repacked = f" (repacked to N={', '.join(map(str, g.repacked))})" if g.repacked else ""
            pruned = f", pruned {g.pruned}{repacked}" if g.pruned else ""
            ran = f"{g.strategy or 'a loop'} ({g.why})"
            lines.append(f"  group {i}: trials {g.trials} as {ran}, {g.seconds:.1f} s{pruned}")
        return "\n".join(lines)


def _on(device: str, tree: Any) -> Any:
    """Every tensor of `tree` on `device`, its dtype kept (token ids stay integers)."""
    return trees.map_leaves(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _suggested(suggest: Callable[[Any], Dict[str, Any]], trial: Any) -> Dict[str, Any]:
    params = suggest(trial)
    if not isinstance(params, dict):
        what = type(params).__name__
        raise WideTesseraError(f"suggest(trial) returned {what}; return a dict of the trial's parameters")
    return params


@dataclass
class _Member:
    trial: Any
    params: Dict[str, Any]
    model: nn.Module
    draws: _Draws


def _loss(training: Training, output: Any, target: Any) -> torch.Tensor:
    loss = training.loss(output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WideTesseraError(f"loss(output, target) returned {what}: return one trial's loss, a scalar tensor")
    return loss


def optimize(
    study: Any,
    suggest: Callable[[Any], Dict[str, Any]],
    build: Callable[[Dict[str, Any]], nn.Module],
    training: Training,
    n_trials: int,
    group_size: Optional[int] = None,
    table: Union[None, str, Path] = None,
    strategy: Optional[str] = None,
    device: str = "cpu",
    progress: bool = True,
) -> StudySummary:
    """Run `n_trials` trials of `study`, each group of trials whose models share a shape trained
    as one fused model (see the module's docstring). suggest(trial) -> the trial's parameters
    (Optuna's define-by-run: trial.suggest_float(...)); build(params) -> its model; training: how
    it trains. group_size: trials per group (None: the largest N the dispatch `table` says fuses
    a training step, measured here where it says nothing, capped by memory). strategy: the fused
    strategy every group runs (fuse(strategy=...)); None: the table's choice at the group's N,
    measured here where it says nothing."""
    if optuna is None:
        raise MissingDependency("wide_tessera.integrations.optuna needs optuna: pip install optuna")
    if not isinstance(study, optuna.Study):
        raise WideTesseraError(f"study={study!r}: give an optuna.Study (optuna.create_study(...))")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise WideTesseraError(f"n_trials={n_trials!r}: give a positive int")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise WideTesseraError(f"group_size={group_size!r}: give a positive int, or None to size groups by measurement")
    if not isinstance(training, Training):
        raise WideTesseraError(f"training={training!r}: give a wide_tessera.integrations.optuna.Training")
    device = resolve_device(device)
    if len(study.directions) != 1:
        raise WideTesseraError(
            f"the study has {len(study.directions)} objectives: optimize trains each trial to one loss; give a "
            "single-objective study"
        )
    table_path = Path(table) if table is not None else default_table_path()
    start = time.perf_counter()
    pending: Dict[str, List[_Member]] = {}
    sizes: Dict[str, Tuple[int, str]] = {}
    shapes: Dict[str, List[Dict[str, Any]]] = {}
    groups: List[GroupRecord] = []
    estimate: Optional[float] = None
    asked, sizing, pruned_by_suggest = 0, 0.0, 0
    # every draw the study makes (sizing, timing, training) on a fork: the caller's generator stays as it was
    with _forked(device):
        numbers: List[int] = []  # the trials this call asked
        try:
            while asked < n_trials or pending:
                ready = next((k for k, ms in pending.items() if len(ms) >= sizes[k][0]), None)
                if ready is None and asked < n_trials:
                    trial = study.ask()
                    asked += 1
                    numbers.append(trial.number)
                    try:
                        params = _suggested(suggest, trial)
                    except optuna.TrialPruned:  # as study.optimize does: this trial is over, the study goes on
                        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                        pruned_by_suggest += 1
                        continue
                    seed = trial_seed(trial, params)
                    member = _Member(
                        trial, params, _build(build, trial, params, device).to(device), _Draws(seed, device)
                    )
                    key = _shape_key(member.model, member.draws.batch(training, params, 0, keep=False)[0])
                    if key not in sizes:
                        began = time.perf_counter()
                        sizes[key] = _group_size(
                            build, member, training, group_size, strategy, table_path, n_trials, device
                        )
                        sizing += time.perf_counter() - began
                    if estimate is None:
                        estimate = _step_seconds(member, training, device) * training.steps * n_trials
                    pending.setdefault(key, []).append(member)
                    shapes.setdefault(key, []).append(params)
                    continue
                key = ready if ready is not None else next(iter(pending))
                members, rest = pending[key][: sizes[key][0]], pending[key][sizes[key][0] :]
                if rest:
                    pending[key] = rest
                else:
                    del pending[key]
                plan = _Plan(training, table_path, strategy, device)
                clock = (start, estimate or 0.0) if progress else None
                with _seeded(device, members[0].draws.training_seed):  # the group's dropout masks
                    groups.append(_train_group(study, members, plan, clock, len(groups), key))
        except BaseException:  # as study.optimize does: a trial that raised, or was interrupted, FAILED
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                if t.number in numbers:
                    study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            raise
    told_apart = _shape_params(shapes)
    labels = {key: _label(key, params[0], told_apart) for key, params in shapes.items()}
    for g in groups:
        g.shape = labels[g.shape]
    return StudySummary(
        {labels[key]: why for key, (_, why) in sizes.items()},
        groups,
        time.perf_counter() - start,
        estimate or 0.0,
        told_apart,
        sizing,
        pruned_by_suggest,
    )


def _label(key: str, params: Dict[str, Any], told_apart: List[str]) -> str:
    """A shape as a person reads it: the model's class, and the values of the parameters that
    tell the shapes apart."""
    name = key[2 : key.index("'", 2)]  # _shape_key's repr begins with the class's name
    return " ".join([name, *(f"{p}={params[p]!r}" for p in told_apart)])


def _shape_key(model: nn.Module, x: Any) -> str:
    """What N models must share to train as one: their class, what every fused strategy needs
    alike (ops.base.layout_of: each tensor's shape, dtype and device, each plain setting), and
    their inputs' shapes and dtypes, which pack stacks: a batch size suggested per trial changes
    no model, and its trials, grouped together, failed the whole study at their first step
    (found by a review)."""
    leaves, _ = trees.flat(x)
    inputs = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in leaves]
    return repr((type(model).__qualname__, sorted(layout_of(model).items()), inputs))


def _shape_params(shapes: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    """The suggested parameters whose values tell the groups' shapes apart: one value within each
    shape, different values between them."""
    if len(shapes) < 2:
        return []
    names = set.intersection(*(set(p) for ps in shapes.values() for p in ps))
    found = []
    for name in sorted(names):
        per_shape = [{repr(p[name]) for p in ps} for ps in shapes.values()]
        if all(len(v) == 1 for v in per_shape) and len(set.union(*per_shape)) > 1:
            found.append(name)
    return found


def _group_size(
    build: Callable[[Dict[str, Any]], nn.Module],
    member: _Member,
    training: Training,
    given: Optional[int],
    strategy: Optional[str],
    table: Path,
    n_trials: int,
    device: str,
) -> Tuple[int, str]:
    """How many trials of this shape train as one, and why (a given size whose strategy the table
    does not say is measured, so that fuse() finds its entry)."""
    cap, memory = _memory_cap(member, training, device)
    if given is not None:
        size = min(given, n_trials)
        if strategy is None and size > 1 and _verdicts(member, [size], table)[size][1] == "none":
            _measure(build, member, training, [size], table, device)
        capped = f" ({given} given; {n_trials} trials)" if size < given else ""
        return size, f"{size}, as given{capped}" + (f" (memory would allow {cap})" if cap < size else "")
    ns = [n for n in _MEASURED_NS if n <= min(n_trials, cap)]
    if not ns:
        return 1, f"1: {memory} allows one model"
    verdicts = _verdicts(member, ns, table)
    if not any(v in _DECIDED for _, v in verdicts.values()):  # nothing measured, or nothing measured cleanly
        _measure(build, member, training, ns, table, device)
        verdicts = _verdicts(member, ns, table)
    fusing = [n for n, (fuses, _) in verdicts.items() if fuses]
    said = ", ".join(f"N={n} {v}" for n, (_, v) in verdicts.items())
    if not fusing:
        undecided = not any(v in _DECIDED for _, v in verdicts.values())
        hint = "; on a quieter machine, or with group_size=, it may fuse" if undecided else ""
        return 1, f"1, one trial at a time: no measured N fuses a training step ({said}; {table}){hint}"
    size = max(fusing)
    return size, f"{size}: the largest N at which a training step fuses on this machine ({said}; {table}), {memory}"


# the table's verdicts that decided something (dispatch.table.N_VERDICTS): the others ask to measure again
_DECIDED = ("fuse", "marginal", "same", "loop")


def _verdicts(member: _Member, ns: Sequence[int], table: Path) -> Dict[int, Tuple[bool, str]]:
    """What the table says of a training step of N of this model at each of `ns`: whether fuse()
    fuses N of them (its rule: the measured N deciding N fused, and every larger measured N), and
    the verdict measured at that N ('none' where the table has no entry)."""
    out = {}
    for n in ns:
        match, _ = decide_at(member.model, n, table, mode="train")
        at_n = [v for e in match.entries for v in e.verdicts if v.n == match.measured_n]
        out[n] = match.fuse, at_n[0].verdict if at_n else "none"
    return out


def _measure(
    build: Callable[[Dict[str, Any]], nn.Module], member: _Member, training: Training, ns: Sequence[int], table: Path,
    device: str,
) -> None:  # fmt: skip
    """benchmark_custom of this model's training step at `ns` (N models built afresh, each its own
    weights), merged into the table."""
    params = member.params
    x, _ = member.draws.batch(training, params, 0, keep=False)
    result = benchmark_custom(
        partial(build, dict(params)),
        None,
        [1, *ns],
        input_factory=lambda: trees.clone(x),
        mode="train",
        confirm="all",  # fuse() fuses N only where every larger measured N fused, confirmed: measure them all
        randomness="different",
        device=device,
        verbose=False,
        timing=TimingConfig(budget_s=0.25),
    )
    table.parent.mkdir(parents=True, exist_ok=True)
    merge_into(table, result)


def _memory_cap(member: _Member, training: Training, device: str) -> Tuple[int, str]:
    """How many models' training fits in half the device's free memory: a model's weights,
    gradients and two optimizer moments, and its input and output three times over (forward,
    backward, the packed copy)."""
    x, _ = member.draws.batch(training, member.params, 0, keep=False)
    with torch.no_grad():  # on a copy: a call in train mode moves BatchNorm's statistics
        y = trees.call(copy.deepcopy(member.model), x)
    weights = sum(t.numel() * t.element_size() for t in member.model.state_dict().values())
    io = sum(t.numel() * t.element_size() for t in trees.tensors([x, y]))
    per_model = 4 * weights + 3 * io
    free = torch.cuda.mem_get_info()[0] if torch.device(device).type == "cuda" else psutil.virtual_memory().available
    cap = max(1, int(free / 2 // max(per_model, 1)))
    return cap, f"memory for {cap} ({per_model / 2**20:.1f} MiB a model, {free / 2**30:.1f} GiB free)"


def _step_seconds(member: _Member, training: Training, device: str) -> float:
    """One training step of one model alone, timed after a first one (on copies)."""
    model = copy.deepcopy(member.model)
    opt = OPTIMIZERS[training.optimizer][0](model.parameters(), **training.settings(member.params))
    times = []
    for step in range(3):
        x, y = member.draws.batch(training, member.params, step % training.steps, keep=False)
        begin = time.perf_counter()
        _loss(training, trees.call(model, x), y).backward()
        opt.step()
        opt.zero_grad()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return min(times[1:])


@dataclass(frozen=True)
class _Plan:
    """How every group of a study trains: the training, the table fuse() decides from, the strategy
    forced (None: the table's), the device."""

    training: Training
    table: Path
    strategy: Optional[str]
    device: str


class _Group:
    """The trials of one group as they train: the fused model, its optimizer and schedule."""

    def __init__(self, members: List[_Member], plan: _Plan):
        self.members, self.plan, training = members, plan, plan.training
        models = [m.model for m in members]
        strategy = "loop" if len(models) == 1 else plan.strategy  # one trial: nothing to fuse, nothing to ask
        self.fused: Fused = fuse(models, table=plan.table, mode="train", randomness="different", strategy=strategy)
        cls = OPTIMIZERS[training.optimizer][1]
        settings = [training.settings(m.params) for m in members]
        defaults = inspect.signature(cls).parameters  # torch's, for a setting a trial does not suggest
        kwargs = {k: [s.get(k, defaults[k].default) for s in settings] for k in set().union(*settings)}
        self.opt = cls(self.fused, **kwargs)
        self.schedule = optim.CosineAnnealingLR(self.opt, T_max=training.steps) if training.cosine else None

    def step(self, step: int) -> List[float]:
        training = self.plan.training
        batches = [_on(self.plan.device, m.draws.batch(training, m.params, step)) for m in self.members]
        outs = self.fused.unpack(self.fused(self.fused.pack([x for x, _ in batches])))
        losses = [_loss(training, o, y) for o, (_, y) in zip(outs, batches)]
        sum(losses).backward()
        if training.clip is not None:
            optim.clip_grad_norm_(self.fused, training.clip)
        self.opt.step()
        self.opt.zero_grad()
        if self.schedule is not None:
            self.schedule.step()
        return [float(loss.detach()) for loss in losses]

    def without(self, kept: List[int], step: int) -> "_Group":
        """The group repacked with only the members at `kept`, after step `step`: their weights and
        optimizer states as they are, their schedule where it is."""
        models = self.fused.unfuse()
        states = self.opt.state_dicts()
        members = [replace(self.members[i], model=models[i]) for i in kept]
        regroup = _Group(members, self.plan)
        regroup.opt.load_state_dicts([states[i] for i in kept])  # each model's lr as scheduled, its initial lr
        if regroup.schedule is not None:  # at its position: step + 1 steps taken
            regroup.schedule = optim.CosineAnnealingLR(regroup.opt, T_max=self.plan.training.steps, last_epoch=step)
        return regroup


def _train_group(
    study: Any, members: List[_Member], plan: _Plan, clock: Optional[Tuple[float, float]], index: int, key: str
) -> GroupRecord:
    """Train one group to the end (reporting each trial's mean loss, pruning and repacking on the
    way), and tell Optuna each surviving trial's value. `clock`: when the study began and the
    sequential study's estimated time, for the progress bar (None: no bar)."""
    start, training = time.perf_counter(), plan.training
    if len(members) == 1:
        return _train_one(study, members[0], plan, clock, index, key)
    group = _Group(members, plan)
    record = GroupRecord(
        [m.trial.number for m in members], key, group.fused.strategy, group.fused.decision.match.reason, 0.0
    )
    _label_trials(members, group.fused.strategy)
    history: Dict[int, List[float]] = {m.trial.number: [] for m in members}
    values: Dict[int, float] = {}
    what = f"group {index}: {len(members)} trials, {group.fused.strategy or 'loop'}"
    bar = tqdm(total=training.steps, desc=what, disable=clock is None, leave=False)
    for step in range(training.steps):
        for m, loss in zip(group.members, group.step(step)):
            history[m.trial.number].append(loss)
        bar.update(1)
        if not training.reports_at(step):
            continue
        kept = []
        for i, m in enumerate(group.members):
            values[m.trial.number] = training.reported(history[m.trial.number])
            m.trial.report(values[m.trial.number], step)
            if m.trial.should_prune():  # at the last report too, as an objective asks its pruner
                group.opt.freeze(i)
                study.tell(m.trial, state=optuna.trial.TrialState.PRUNED)
                record.pruned.append(m.trial.number)
            else:
                kept.append(i)
        if not kept:
            break
        if len(kept) < len(group.members):  # a pruned trial stops costing time
            group = group.without(kept, step)
            record.repacked.append(len(kept))
        if clock is not None:
            elapsed = f"{time.perf_counter() - clock[0]:.0f}s of ~{clock[1]:.0f}s sequential"
            bar.set_postfix(training=len(group.members), pruned=len(record.pruned), study=elapsed)
    bar.close()
    if len(record.pruned) < len(members):
        models = group.fused.unfuse() if training.evaluate is not None else []
        for i, m in enumerate(group.members):
            value = training.evaluate(models[i], m.params) if training.evaluate is not None else values[m.trial.number]
            study.tell(m.trial, value)
    record.seconds = time.perf_counter() - start
    return record


def _label_trials(members: List[_Member], strategy: Optional[str]) -> None:
    for m in members:
        m.trial.set_user_attr("wide_tessera_group", members[0].trial.number)  # unique in the study, whatever call
        m.trial.set_user_attr("wide_tessera_strategy", strategy or "loop")


def _train_one(
    study: Any, member: _Member, plan: _Plan, clock: Optional[Tuple[float, float]], index: int, key: str
) -> GroupRecord:
    """A group of one trial trains as the sequential loop trains it (`_train_alone`): nothing to
    fuse, and no wrapper to pay for (through fuse()'s loop and wide_tessera.optim it cost 5% of a
    trial of hidden 256, one trial at a time)."""
    start, number = time.perf_counter(), member.trial.number
    record = GroupRecord([number], key, None, "one trial: nothing to fuse", 0.0)
    _label_trials([member], None)
    bar = tqdm(
        total=plan.training.steps, desc=f"group {index}: trial {number} alone", disable=clock is None, leave=False
    )
    try:
        value = _train_alone(member.trial, member.params, member.model, member.draws, plan.training, plan.device,
                             lambda: bar.update(1))  # fmt: skip
    except optuna.TrialPruned:
        study.tell(member.trial, state=optuna.trial.TrialState.PRUNED)
        record.pruned.append(number)
    else:
        study.tell(member.trial, value)
    bar.close()
    record.seconds = time.perf_counter() - start
    return record
