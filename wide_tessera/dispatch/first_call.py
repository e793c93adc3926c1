"""fuse(modules, measure='first-call'): where no table entry decides, the first call decides.

Like cuDNN's `benchmark = True`: the first forward measures the N separate calls against each
strategy of the op on the real input, checks every strategy's outputs against the separate
calls (one that differs is never chosen), stops as soon as the decision is settled
(results.decisions) or the time bound is spent, keeps the winner for every later call, and
writes the entry to the table file, marked as measured on first use (preset 'first call'),
so that the next process fuses from it without measuring.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core import trees
from ..core.capabilities import Needs, unmet_need
from ..core.correctness import check_outputs, tolerance
from ..core.files import results_lock
from ..core.job import DTYPES
from ..core.stats import paired_ratio
from ..measurement.settings import RunSettings
from ..measurement.timing import TimingConfig, measure_paired
from ..ops.base import wide_module
from ..results.decisions import decide, level_of, stop_rule
from ..results.manifest import now
from .table import FIRST_CALL, Case, DispatchEntry, DispatchTable, Match, NVerdict

__all__ = ["FirstCall", "op_trials"]


def op_trials(cls: type) -> Tuple[Sequence[str], Callable[[List[nn.Module], str], nn.Module], Dict[str, Needs]]:
    """What a first call of op `cls` tries: its strategies, how each is built, what each needs."""
    return cls.BENCHMARK_STRATEGIES, partial(wide_module, cls), cls.strategy_needs()


class FirstCall(nn.Module):
    """N modules whose first call measures and decides; pack, forward and unpack as the other
    fused modules have them (the packed value is the N inputs: whichever side won packs them
    itself on every call). `decision` says what decided, after the first call too."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        strategies: Sequence[str],
        build: Callable[[List[nn.Module], str], nn.Module],
        needs: Dict[str, Needs],
        case: Case,
        table_path: Optional[str],
        time_bound_s: float,
        announce: Callable[[Match], Any],
    ):
        """`strategies` are tried, each built by `build(modules, strategy)` where the run gives
        what `needs[strategy]` asks: an op's own, or a custom class's vmap and surgery."""
        super().__init__()
        self.models = nn.ModuleList(modules)
        self._strategies, self._build, self._needs = tuple(strategies), build, needs
        self._case, self._table, self._bound = case, table_path, time_bound_s
        self._announce = announce
        self._chosen: Optional[Callable[[List[Any]], List[Any]]] = None
        self._wide: Optional[nn.Module] = None

    def pack(self, inputs: Sequence[Any]) -> Tuple[Any, ...]:
        if not isinstance(inputs, (list, tuple)) or len(inputs) != len(self.models):
            raise ValueError(f"pack needs a list of {len(self.models)} inputs, one per module")
        return tuple(inputs)

    def forward(self, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if self._chosen is None:
            self._decide(list(inputs))
        return tuple(self._chosen(list(inputs)))

    def unpack(self, output: Tuple[Any, ...]) -> List[Any]:
        return list(output)

    def _loop(self, inputs: List[Any]) -> List[Any]:
        return [trees.call(m, x) for m, x in zip(self.models, inputs)]

    def _decide(self, inputs: List[Any]) -> None:
        case, device = self._case, str(inputs_device(inputs))
        candidates: Dict[str, nn.Module] = {}
        with torch.no_grad():
            reference = self._loop([trees.clone(x) for x in inputs])
            tol = tolerance(DTYPES[case.dtype], device)
            for strategy in self._strategies:
                if unmet_need(self._needs.get(strategy), device, DTYPES[case.dtype], case.params):
                    continue
                try:
                    wide = self._build(list(self.models), strategy)
                    out = wide.unpack(wide(wide.pack([trees.clone(x) for x in inputs])))
                except Exception:  # noqa: BLE001  a strategy that cannot run here is not chosen
                    continue
                if check_outputs(out, reference, tol).correct:  # a wrong strategy is never chosen
                    candidates[strategy] = wide
            timed: Dict[str, Callable[[], object]] = {"baseline": lambda: self._loop(inputs)}
            for strategy, wide in candidates.items():
                packed = wide.pack(inputs)
                timed[strategy] = lambda wide=wide, packed=packed: wide(packed)
            settings = RunSettings(device=device, timing=TimingConfig(budget_s=self._bound / len(timed)))
            stop = stop_rule(list(candidates), [], settings)
            stats = measure_paired(timed, device, settings.timing, stop=stop).stats
        samples = {name: st.samples_ms for name, st in stats.items()}
        call = decide(samples, list(candidates), level_of(settings))
        if call.kind == "fuse":
            self._wide = candidates[call.strategy]
            wide = self._wide
            self._chosen = lambda xs: wide.unpack(wide(wide.pack(xs)))
        else:
            self._chosen = self._loop
        verdict = {"fuse": "fuse", "marginal": "marginal", "open": "open"}.get(call.kind, "loop")
        best = call.strategy
        speedup = None if best is None else paired_ratio(samples["baseline"], samples[best])[0]
        entry = DispatchEntry(
            op=case.op, device=case.device, device_name=case.device_name, dtype=case.dtype, mode=case.mode,
            compile=case.compile, cuda_graph=case.cuda_graph, params=case.params,
            verdicts=[NVerdict(case.n, verdict, best, speedup)],
            crossover_n=case.n if verdict == "fuse" else None, measured_at=now(),
            versions={"torch": torch.__version__}, threads=torch.get_num_threads(), preset=FIRST_CALL,
        )  # fmt: skip
        reason = (
            f"measured on its first call: {best} {speedup:.2f}x, {call.kind}" if speedup is not None else
            f"measured on its first call: no strategy ran correctly here, {call.kind}"
        )  # fmt: skip
        self._announce(Match(verdict == "fuse", best if verdict == "fuse" else None, (entry,), 0.0, case.n, reason))
        if self._table is not None:
            _merge(self._table, entry)


def inputs_device(inputs: List[Any]) -> torch.device:
    tensors = trees.tensors(inputs)
    return tensors[0].device if tensors else torch.device("cpu")


def _merge(path: str, entry: DispatchEntry) -> None:
    """Add the entry to the table file; a table that cannot be written is a warning, never an error
    in the model's forward."""
    try:
        with results_lock(path):
            table = DispatchTable.load(path) if Path(path).exists() else DispatchTable()
            table.merged([entry]).save(path)
    except Exception as e:  # noqa: BLE001  the decision stands in this process; only its record is lost
        warnings.warn(f"the first call's measurement was not written to {path}: {e}", stacklevel=3)

