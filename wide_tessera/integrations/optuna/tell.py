"""How each trial of a call begins and ends, as `study.optimize` has it: stale trials failed and a
heartbeat started at the ask (on a storage that keeps heartbeats: an RDB storage given a
`heartbeat_interval`), and at the tell the heartbeat stopped, the garbage collected where asked,
the callbacks called; a trial that raised failed alone, its error raised once its group is told
unless `catch` names its type. Without heartbeats, a worker killed in the middle of a group left
its trials RUNNING for good, where study.optimize's killed trial is failed as stale at the next
optimize."""

from __future__ import annotations

import copy
import gc
import math
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Type

from ...core.errors import WideTesseraError
from .host import optuna

Callback = Callable[[Any, Any], None]


def checked_contract(
    timeout: Optional[float], catch: Any, callbacks: Optional[Iterable[Callback]]
) -> Tuple[Optional[float], Tuple[Type[Exception], ...], List[Callback]]:
    """optimize's timeout, catch and callbacks, checked as study.optimize takes them."""
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0
    ):
        raise WideTesseraError(f"timeout={timeout!r}: give a positive number of seconds, or None")
    if not isinstance(catch, tuple) or not all(isinstance(c, type) and issubclass(c, Exception) for c in catch):
        raise WideTesseraError(f"catch={catch!r}: give a tuple of exception classes, as study.optimize takes it")
    listed = list(callbacks or [])
    if not all(callable(c) for c in listed):
        raise WideTesseraError(f"callbacks={callbacks!r}: give callables cb(study, frozen_trial)")
    return timeout, catch, listed


class Teller:
    """The trials of one `optimize` call from ask to tell (see the module's docstring)."""

    def __init__(self, study: Any, catch: Tuple[Type[Exception], ...], callbacks: List[Callback], gc_after: bool):
        self.study, self.catch, self.callbacks, self.gc_after = study, catch, callbacks, gc_after
        self.beats: Dict[int, Any] = {}  # each running trial's heartbeat, by trial number
        self.raised: Optional[Exception] = None  # the first error `catch` does not name: raised after its group

    def ask(self) -> Any:
        """A new trial, its heartbeat started (stale trials of killed workers failed first)."""
        storage = self.study._storage
        if optuna.storages._heartbeat.is_heartbeat_enabled(storage):
            with warnings.catch_warnings():  # fail_stale_trials is experimental, and study.optimize calls it alike
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(self.study)
        trial = self.study.ask()
        beat = optuna.storages._heartbeat.get_heartbeat_thread(trial._trial_id, storage)
        beat.start()
        self.beats[trial.number] = beat
        return trial

    def tell(self, trial: Any, value: Optional[float] = None, state: Any = None) -> None:
        """study.tell(trial, value, state) (a trial, or its number), then what follows a tell."""
        frozen = self.study.tell(trial, value, state=state)
        self.beats.pop(trial if isinstance(trial, int) else trial.number).join()
        if self.gc_after:
            gc.collect()
        for callback in self.callbacks:
            callback(self.study, copy.deepcopy(frozen))

    def failed(self, trial: Any, error: Exception) -> None:
        """A trial whose own code raised: FAIL, alone (its group goes on without it)."""
        optuna.logging.get_logger("optuna").warning(
            f"Trial {trial.number} failed with parameters: {trial.params} because of the following error: {error!r}."
        )
        self.tell(trial, state=optuna.trial.TrialState.FAIL)
        if not isinstance(error, self.catch) and self.raised is None:
            self.raised = error

    def fail_running(self) -> None:
        """Every trial of this call not yet told FAIL: the study was interrupted, or an error raised."""
        for number in list(self.beats):
            self.tell(number, state=optuna.trial.TrialState.FAIL)
