"""fuse(modules, measure='first-call'): where no table entry decides, the first call decides.

Like cuDNN's `benchmark = True`: the first forward measures the N separate calls against each
strategy of the op on the real input, checks every strategy's outputs against the separate
calls (one that differs is never chosen), stops as soon as the decision is settled
(results.decisions) or the time bound is spent, keeps the winner for every later call, and
writes the entry to the table file, marked as measured on first use (preset 'first call'),
so that the next process fuses from it without measuring.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core import trees
from ..core.capabilities import unmet_need
from ..core.correctness import check_outputs, tolerance
from ..core.job import DTYPES
from ..core.roles import BASELINE
from ..core.stats import paired_ratio
from ..measurement.modes import preserved
from ..measurement.settings import RunSettings
from ..measurement.timing import TimedFunctionError, TimingConfig, measure_paired
from ..results.decisions import Call, decide, level_of, stop_rule
from ..results.manifest import now
from .build import DispatchDecision, Fused, LoopedModules, Trials
from .handover import replaced
from .table import FIRST_CALL, Case, DispatchEntry, Match, NVerdict, measured_entry, merge_entries

__all__ = ["FirstCall"]

# Until the first call has measured, what the decision says.
_UNDECIDED = "no measured entry: the first call measures the loop against the strategies and decides"


class FirstCall(Fused):
    """N modules whose first call measures and decides; the packed value is the N inputs:
    whichever side won packs them itself on every call. `decision` says what decided, after the
    first call too. Until then `runs` is the loop; a first call that chooses a wide module makes
    it `runs`, built from the modules' weights as they are then, and hands torch optimizers made
    over the loop's parameters to it at their next step (dispatch.handover)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        trials: Trials,
        case: Case,
        table_path: Optional[str],
        time_bound_s: float,
        source: Optional[str],
    ):
        """`trials` says which strategies are tried and how each is built, where the run gives what
        it needs: an op's own, or a custom class's vmap and surgery. The entry measured is written
        to `table_path` (None: kept in this process); `source` names the table the decision
        cites."""
        undecided = DispatchDecision(case, Match(False, None, (), None, None, _UNDECIDED), source)
        super().__init__(modules, LoopedModules(modules), undecided)
        self._trials, self._case, self._table, self._bound = trials, case, table_path, time_bound_s
        self._decided = False

    def _pack(self, inputs: List[Any]) -> Tuple[Any, ...]:
        return tuple(inputs)  # Fused.pack checked there are N

    def _unpack(self, output: Tuple[Any, ...]) -> List[Any]:
        return list(output)

    def _forward(self, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if not self._decided and _on_meta(inputs, self._given):
            return tuple(self._loop(list(inputs)))  # nothing on the meta device can be timed: decide on a real call
        if not self._decided:
            self._decide(list(inputs))
        wide: Any = self.runs  # a wide module: pack, call, unpack (nn.Module's typing cannot say so)
        if self.strategy is None:
            return tuple(wide(inputs))
        return tuple(wide.unpack(wide(wide.pack(list(inputs)))))

    def _loop(self, inputs: List[Any]) -> List[Any]:
        return trees.call_each(self._given, inputs)

    def _correct(self, inputs: List[Any], deadline: float) -> Tuple[Dict[str, Any], float]:
        """Each strategy that can run here, built, whose outputs match the separate calls' (a wrong
        strategy is never chosen), and the seconds a warm call of the loop took (a first call of
        16 small Linears took 54 ms where a second took 0.3 ms).
        The separate calls run under `preserved`, so each strategy is built from the buffers the
        modules had before this call, and checked under `preserved` too: the one chosen then runs
        from those (a wide module built after the separate calls, and checked as it was, held
        BatchNorm's statistics of three batches after the first call's one). Past `deadline`, one
        correct strategy is enough: no further one is built (10,000 Linears took 0.3 s to build
        and 0.6 s to check, a strategy)."""
        case, device = self._case, str(inputs_device(inputs))
        with preserved(self._given):
            reference = self._loop([trees.clone(x) for x in inputs])
            started = time.perf_counter()
            self._loop([trees.clone(x) for x in inputs])
            loop_s = time.perf_counter() - started
        tol = tolerance(DTYPES[case.dtype], device)
        correct: Dict[str, Any] = {}  # wide modules: pack, call, unpack (nn.Module's typing cannot say so)
        for strategy in self._trials.strategies:
            if correct and time.perf_counter() > deadline:
                break
            if unmet_need(self._trials.needs.get(strategy), device, DTYPES[case.dtype], case.params):
                continue
            try:
                wide: Any = self._trials.make(list(self._given), strategy)
                with preserved([wide]):
                    out = wide.unpack(wide(wide.pack([trees.clone(x) for x in inputs])))
            except Exception:  # noqa: BLE001  a strategy that cannot run here is not chosen
                continue
            if check_outputs(out, reference, tol).correct:
                correct[strategy] = wide
        return correct, loop_s

    def _decide(self, inputs: List[Any]) -> None:
        """Measure, keep the answer as `decision`, write the entry, and run the winner from now on.

        The measurement leaves no trace on the modules or the random state: buffers a call
        updates (BatchNorm's running statistics) are restored, and random draws (dropout) are
        made on a forked generator, so this call's own run is the one the separate calls make."""
        device = str(inputs_device(inputs))
        started = time.perf_counter()
        with torch.no_grad(), torch.random.fork_rng(_cuda_devices(device)), preserved(self._given):
            candidates, loop_s = self._correct(inputs, started + self._bound)
            # the fewest rounds a decision takes, each a call of the loop and, at most as long
            # where fusing can pay, one of the strategies: over twice the bound, not measured
            left_s = started + self._bound - time.perf_counter()
            needed_s = TimingConfig().min_samples * 2 * loop_s
            if candidates and needed_s > left_s + self._bound:
                self._keep_the_loop(needed_s, time.perf_counter() - started)
                return
            with preserved(list(candidates.values())):
                stats = self._measure(inputs, candidates, device, max(left_s, 1e-3))
        settings = RunSettings(device=device)
        samples = {name: st.samples_ms for name, st in stats.items()}
        call = decide(samples, list(candidates), level_of(settings))
        entry = self._entry(call, samples)
        verdict = entry.verdicts[0]
        reason = (
            f"measured on its first call: {verdict.strategy} {verdict.speedup:.2f}x, {call.kind}"
            if verdict.speedup is not None
            else f"measured on its first call: no strategy ran correctly here, {call.kind}"
        )
        fused = call.kind == "fuse" and call.strategy is not None
        match = Match(fused, verdict.strategy if fused else None, (entry,), 0.0, self._case.n, reason)
        self.decision = replace(self.decision, match=match)
        self._decided = True
        if self._table is not None:
            _merge(self._table, entry)
        if fused and call.strategy is not None:
            loop, wide = self.runs, candidates[call.strategy]
            self.runs = wide.train(loop.training)
            replaced(loop, wide, self.n)

    def _measure(self, inputs: List[Any], candidates: Dict[str, Any], device: str, budget_s: float) -> Dict[str, Any]:
        """The loop and the candidates timed together in `budget_s`. A strategy that raises is left
        out (it is not chosen); the separate calls raising is the modules' own error, of its own type:
        they cannot be called again as the first call must to time them."""
        timed: Dict[str, Callable[[], object]] = {BASELINE: lambda: self._loop(inputs)}
        for strategy, wide in candidates.items():
            timed[strategy] = partial(wide, wide.pack(inputs))
        while True:
            share = budget_s / len(timed)  # its warm-up too: 25 ms a side took a 0.05 s bound to 0.18 s
            timing = TimingConfig(budget_s=share, warmup_s=min(TimingConfig.warmup_s, share / 4))
            settings = RunSettings(device=device, timing=timing)
            stop = stop_rule([s for s in timed if s != BASELINE], [], settings)
            try:
                return measure_paired(timed, device, settings.timing, stop=stop).stats
            except TimedFunctionError as e:
                if e.name == BASELINE:
                    if hasattr(e.error, "add_note"):  # Python 3.11 and later
                        e.error.add_note("raised by a repeated call of the separate modules: the first call times them")
                    raise e.error from None
                del timed[e.name], candidates[e.name]

    def _keep_the_loop(self, needed_s: float, spent_s: float) -> None:
        """Decide for the loop without measuring: timing would take the first call past twice its
        time bound (10,000 Linears took 26.8 s against a bound of 0.5 s, building and checking
        every strategy, then timing a loop of 94 ms a call). Nothing is written to the table."""
        reason = (
            f"not measured on its first call: building and checking took {spent_s:.2f} s and timing would take "
            f"about {needed_s:.2f} s more, past the time bound of {self._bound:g} s; runs the loop "
            "(a larger time_bound_s, or `wide_tessera tune` ahead of time, measures it)"
        )
        self.decision = replace(self.decision, match=Match(False, None, (), None, None, reason))
        self._decided = True

    def _entry(self, call: Call, samples: Dict[str, List[float]]) -> DispatchEntry:
        """The table entry of this one measured N; a Call's kinds (fuse, marginal, loop, open) are
        table verdicts as they are. The speedup is the paired ratio the decision rests on."""
        best = call.strategy
        speedup = None if best is None else paired_ratio(samples[BASELINE], samples[best])[0]
        verdicts = [NVerdict(self._case.n, call.kind, best, speedup)]
        versions: Dict[str, Optional[str]] = {"torch": torch.__version__}
        return measured_entry(self._case, verdicts, now(), versions, torch.get_num_threads(), FIRST_CALL)


def _on_meta(inputs: Sequence[Any], modules: Sequence[nn.Module]) -> bool:
    tensors = [*trees.tensors(list(inputs)), *(p for m in modules for p in m.parameters())]
    return any(t.is_meta for t in tensors)


def _cuda_devices(device: str) -> List[int]:
    """The CUDA devices whose generators fork_rng forks: the one the call runs on (none on a CPU)."""
    return [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []


def inputs_device(inputs: List[Any]) -> torch.device:
    tensors = trees.tensors(inputs)
    return tensors[0].device if tensors else torch.device("cpu")


def _merge(path: str, entry: DispatchEntry) -> None:
    """Add the entry to the table file; a table that cannot be written is a warning, never an error
    in the model's forward."""
    try:
        merge_entries(path, [entry])
    except Exception as e:  # noqa: BLE001  the decision stands in this process; only its record is lost
        warnings.warn(f"the first call's measurement was not written to {path}: {e}", stacklevel=3)
