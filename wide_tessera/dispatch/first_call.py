"""fuse(modules, measure='first-call'): where no table entry decides, the first call decides.

Like cuDNN's `benchmark = True`: the first forward measures the N separate calls against each
strategy of the op on the real input, checks every strategy's outputs against the separate
calls (one that differs is never chosen), stops as soon as the decision is settled
(results.decisions) or the time bound is spent, keeps the winner for every later call, and
writes the entry to the table file, marked as measured on first use (preset 'first call'),
so that the next process fuses from it without measuring.

The measurement leaves the modules as they were, so the call it decided then runs as the N
separate first calls run. Modules that cannot be called again (one that raised on its second
call made the fused module's first call raise, where N separate first calls succeeded) keep the
loop, and the decision says why: the call is then the separate calls' own. (The call's output
is not taken from the separate calls with the measurement after it: a training step's backward
then ran through the loop, not through the wide module chosen for the steps after it.)
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import nn

from ..core import trees
from ..core.capabilities import unmet_need
from ..core.correctness import check_outputs, nonfinite_reference, tolerance
from ..core.errors import one_line
from ..core.job import DTYPES
from ..core.roles import BASELINE
from ..core.stats import paired_ratio
from ..measurement.modes import preserved
from ..measurement.settings import RunSettings
from ..measurement.timing import TimedFunctionError, TimingConfig, measure_paired, once_s
from ..results.decisions import Call, decide, level_of, stop_rule
from ..results.manifest import now
from ..widen.host_draws import HostGenerators
from .build import DispatchDecision, Fused, LoopedModules, Trials, layer_notes
from .handover import replaced
from .table import FIRST_CALL, Case, DispatchEntry, Match, NVerdict, measured_entry, merge_entries

__all__ = ["FirstCall"]

T = TypeVar("T")

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
        self._untried: List[str] = []  # strategies the first call could not afford to try, and why

    def _pack(self, inputs: List[Any]) -> Tuple[Any, ...]:
        return tuple(inputs)  # Fused.pack checked there are N

    def _unpack(self, output: Tuple[Any, ...]) -> List[Any]:
        return list(output)

    def _forward(self, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        if not self._decided and _on_meta(inputs, self._given):
            return tuple(self._loop(list(inputs)))  # nothing on the meta device can be timed: decide on a real call
        if not self._decided:
            try:
                self._decide(list(inputs))
            except _NotRepeatable as e:  # the modules are as they were: this call is their first
                self._run_the_loop(f"not measured on its first call: {e}; runs the loop")
        wide: Any = self.runs  # a wide module: pack, call, unpack (nn.Module's typing cannot say so)
        if self.strategy is None:
            return tuple(wide(inputs))
        return tuple(wide.unpack(wide(wide.pack(list(inputs)))))

    def _loop(self, inputs: List[Any]) -> List[Any]:
        return trees.call_each(self._given, inputs)

    def _repeat(self, call: Callable[[], T]) -> T:
        """A call of the user's modules made again to measure them; what it raises is _NotRepeatable."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001  the modules' own error: they cannot be measured
            raise _NotRepeatable(e) from None

    def _one_call_s(self, x: Any, device: str) -> float:
        """The seconds a warm call of the first model takes (the fastest of three after one; its
        state as it was before)."""
        with preserved(self._given[:1]):
            copies = [trees.clone(x) for _ in range(4)]
            times = [self._repeat(partial(once_s, partial(trees.call, self._given[0], c), device)) for c in copies]
        return min(times[1:])

    def _reference(self, inputs: List[Any], undo: Callable[[], None], until: float) -> Tuple[List[Any], float]:
        """The separate calls' outputs, and the seconds a call of the loop took: a second, warm
        call's where there is time for it before `until` (a first call of 16 small Linears took
        54 ms where a second took 0.3 ms). What the calls did to the modules is then undone, so
        each strategy is built from the buffers the modules had before this call, and checked
        under `preserved` too: the one chosen then runs from those (a wide module built after the
        separate calls, and checked as it was, held BatchNorm's statistics of three batches after
        the first call's one)."""
        device = str(inputs_device(inputs))
        copies = [trees.clone(x) for x in inputs]
        reference: List[Any] = []
        loop_s = self._repeat(partial(once_s, lambda: reference.extend(self._loop(copies)), device))
        if time.perf_counter() < until:
            copies = [trees.clone(x) for x in inputs]
            loop_s = self._repeat(partial(once_s, partial(self._loop, copies), device))
        undo()
        return reference, loop_s

    def _correct(self, inputs: List[Any], reference: List[Any], started: float) -> Dict[str, Any]:
        """Each strategy that can run here, built, whose outputs match the separate calls' (a wrong
        strategy is never chosen). Past the time bound, one correct strategy is enough: no further
        one is built (10,000 Linears took 0.3 s to build and 0.6 s to check, a strategy); one whose
        first call would take this call past twice the bound (a model torch.export must capture,
        1.3 s) is not tried, and `untried` says so."""
        case, device = self._case, str(inputs_device(inputs))
        tol = tolerance(DTYPES[case.dtype], device)
        correct: Dict[str, Any] = {}  # wide modules: pack, call, unpack (nn.Module's typing cannot say so)
        for strategy in self._trials.strategies:
            if correct and time.perf_counter() > started + self._bound:
                break
            if unmet_need(self._trials.needs.get(strategy), device, DTYPES[case.dtype], case.params):
                continue
            try:
                wide: Any = self._trials.make(list(self._given), strategy)
                setup_s = wide.first_call_s() if hasattr(wide, "first_call_s") else 0.0
                if time.perf_counter() + setup_s > started + 2 * self._bound:
                    self._untried.append(f"{strategy} not tried (its first call takes about {setup_s:.1f} s)")
                    continue
                with preserved([wide]):
                    out = wide.unpack(wide(wide.pack([trees.clone(x) for x in inputs])))
            except Exception:  # noqa: BLE001  a strategy that cannot run here is not chosen
                continue
            if check_outputs(out, reference, tol).correct:
                correct[strategy] = wide
        return correct

    def _decide(self, inputs: List[Any]) -> None:
        """Measure, keep the answer as `decision`, write the entry, and run the winner from now on.

        The measurement leaves no trace on the modules or the random state: buffers a call
        updates (BatchNorm's running statistics) are restored, and random draws (dropout) are
        made on a forked generator, so this call's own run is the one the separate calls make.
        The whole of it, building and checking included, stays within twice the time bound:
        where the fewest rounds a decision takes would not fit, it is not measured."""
        device = str(inputs_device(inputs))
        started = time.perf_counter()
        with torch.no_grad(), torch.random.fork_rng(_cuda_devices(device)), _python_rng_kept():
            # N times one model's call, before the state of all N is taken: 10,000 Linears spent
            # 0.28 s, over five times a 0.05 s bound, on a call of the loop that could not be timed
            guess_s = self.n * self._one_call_s(inputs[0], device)
            if not self._fits(started, guess_s):
                self._keep_the_loop(started, guess_s)
                return
            # (the loop is timed on the user's inputs: a forward that scales its input in place
            # left it at inf, and the call's own run then started from that)
            with preserved(self._given, trees.tensors(inputs)) as undo:
                reference, loop_s = self._reference(inputs, undo, started + 2 * self._bound)
                unjudgeable = nonfinite_reference(reference)
                if unjudgeable is not None:  # NaN weights: every strategy's NaN would match, or none would
                    self._run_the_loop(f"not measured on its first call: {unjudgeable}; runs the loop")
                    return
                if not self._fits(started, loop_s):
                    self._keep_the_loop(started, loop_s)
                    return
                candidates = self._correct(inputs, reference, started)
                if candidates and not self._fits(started, loop_s):
                    self._keep_the_loop(started, loop_s)
                    return
                with preserved(list(candidates.values())):
                    stats = self._measure(inputs, candidates, device, started + self._bound - time.perf_counter())
        settings = RunSettings(device=device)
        samples = {name: st.samples_ms for name, st in stats.items()}
        call = decide(samples, list(candidates), level_of(settings), epsilon=settings.regret)
        entry = self._entry(call, samples)
        verdict = entry.verdicts[0]
        reason = (
            f"measured on its first call: {verdict.strategy} {verdict.speedup:.2f}x, {call.kind}"
            if verdict.speedup is not None
            else f"measured on its first call: no strategy ran correctly here, {call.kind}"
        )
        if self._untried:  # an entry is an answer for every later process: one left out would never be tried
            reason += f"; {', '.join(self._untried)}, past twice the time bound: not written to the table"
        fused = call.kind == "fuse" and call.strategy is not None
        notes = layer_notes(candidates[call.strategy], self.n) if fused and call.strategy is not None else ()
        match = Match(fused, verdict.strategy if fused else None, (entry,), 0.0, self._case.n, reason, notes)
        self.decision = replace(self.decision, match=match)
        self._decided = True
        if self._table is not None and not self._untried and _merge(self._table, entry):
            self.decision = replace(self.decision, table=self._table)  # it said "(not written yet)"
        if fused and call.strategy is not None:
            loop, wide = self.runs, candidates[call.strategy]
            self.runs = wide.train(loop.training)
            replaced(loop, wide, self.n)

    def _needed_s(self, loop_s: float) -> float:
        """The fewest rounds a decision takes, each a call of the loop and, at most as long where
        fusing can pay, one of the strategies."""
        return TimingConfig().min_samples * 2 * loop_s

    def _fits(self, started: float, loop_s: float) -> bool:
        return time.perf_counter() + self._needed_s(loop_s) <= started + 2 * self._bound

    def _measure(self, inputs: List[Any], candidates: Dict[str, Any], device: str, budget_s: float) -> Dict[str, Any]:
        """The loop and the candidates timed together in `budget_s` (none left: the fewest rounds,
        which `_fits` found room for). A strategy that raises is left out (it is not chosen); the
        separate calls raising is the modules' own error, of its own type: they cannot be called
        again as the first call must to time them."""
        timed: Dict[str, Callable[[], object]] = {BASELINE: lambda: self._loop(inputs)}
        for strategy, wide in candidates.items():
            timed[strategy] = partial(wide, wide.pack(inputs))
        while True:
            settings = RunSettings(device=device, timing=_timing(max(budget_s, 0.0) / len(timed)))
            stop = stop_rule([s for s in timed if s != BASELINE], [], settings)
            try:
                return measure_paired(timed, device, settings.timing, stop=stop).stats
            except TimedFunctionError as e:
                if e.name == BASELINE:
                    raise _NotRepeatable(e.error) from None
                del timed[e.name], candidates[e.name]

    def _keep_the_loop(self, started: float, loop_s: float) -> None:
        """Decide for the loop without measuring: timing would take the first call past twice its
        time bound (10,000 Linears took 26.8 s against a bound of 0.5 s, building and checking
        every strategy, then timing a loop of 94 ms a call). Nothing is written to the table."""
        self._run_the_loop(
            f"not measured on its first call: timing would take about {self._needed_s(loop_s):.2f} s after "
            f"{time.perf_counter() - started:.2f} s spent, past twice the time bound of {self._bound:g} s; runs the "
            "loop (a larger time_bound_s, or `wide_tessera tune` ahead of time, measures it)"
        )

    def _run_the_loop(self, reason: str) -> None:
        """Decide for the loop, unmeasured, for `reason`; nothing is written to the table."""
        self.decision = replace(self.decision, match=Match(False, None, (), None, None, reason))
        self._decided = True

    def _entry(self, call: Call, samples: Dict[str, List[float]]) -> DispatchEntry:
        """The table entry of this one measured N; a Call's kinds (fuse, marginal, loop, open) are
        table verdicts as they are. The speedup is the paired ratio the decision rests on."""
        best = call.strategy
        speedup = None if best is None else paired_ratio(samples[BASELINE], samples[best])[0]
        verdicts = [NVerdict(self._case.n, call.kind, best, speedup)]
        versions: Dict[str, Optional[str]] = {"torch": str(torch.__version__)}
        return measured_entry(self._case, verdicts, now(), versions, torch.get_num_threads(), FIRST_CALL)


class _NotRepeatable(Exception):
    """The separate modules raised on a call the measurement made again: they cannot be measured."""

    def __init__(self, error: Exception):
        super().__init__(f"a repeated call of the separate modules raised {one_line(error)}")


def _timing(share_s: float) -> TimingConfig:
    """Timing that spends about `share_s` on a function, its warm-up and its shortest samples
    included: a function's fewest rounds cost about 16 samples (6 to find its calls per sample,
    two a round for 10 rounds, counting the untimed call before each), so the shortest sample is
    a twentieth of the share, within 0.1 to 1 ms: perf_counter's own cost is under 0.1 us here.
    (Samples of 1 ms and 25 ms warm-ups took a first call of 16 Linears to 0.18 s on a 0.05 s bound.)"""
    sample_s = min(TimingConfig.min_sample_s, max(1e-4, share_s / 20))
    warmup_s = min(TimingConfig.warmup_s, share_s / 4)
    return TimingConfig(budget_s=max(share_s, 1e-3), warmup_s=warmup_s, min_sample_s=sample_s)


def _on_meta(inputs: Sequence[Any], modules: Sequence[nn.Module]) -> bool:
    tensors = [*trees.tensors(list(inputs)), *(p for m in modules for p in m.parameters())]
    return any(t.is_meta for t in tensors)


@contextmanager
def _python_rng_kept() -> Iterator[None]:
    """Python's and NumPy's global generators as they were: a model drawing from them moved them on
    at every measured call, and the user's next random.random() was another."""
    kept = HostGenerators()
    try:
        yield
    finally:
        kept.restore()


def _cuda_devices(device: str) -> List[int]:
    """The CUDA devices whose generators fork_rng forks: the one the call runs on (none on a CPU)."""
    return [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []


def inputs_device(inputs: List[Any]) -> torch.device:
    tensors = trees.tensors(inputs)
    return tensors[0].device if tensors else torch.device("cpu")


def _merge(path: str, entry: DispatchEntry) -> bool:
    """Add the entry to the table file, and say whether it was; a table that cannot be written is
    a warning, never an error in the model's forward."""
    try:
        merge_entries(path, [entry])
    except Exception as e:  # noqa: BLE001  the decision stands in this process; only its record is lost
        warnings.warn(f"the first call's measurement was not written to {path}: {e}", stacklevel=3)
        return False
    return True
