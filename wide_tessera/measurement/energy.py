"""Energy per call of each callable of a point, from NVML's total-energy counter (`--energy`).

A median says how long a call takes; on a GPU the other bill is energy, and a fused call
that is no faster can still cost less (one launch, fewer reads of the weights).

Why windows of their own, apart from the timing rounds: NVML moves the counter in steps,
about every 100 ms (ML.ENERGY's Zeus measurements), while a timing sample lasts about a
millisecond, so the counter cannot say which sample spent what; read around samples, every
side would be charged the average power of all of them. Here each callable runs alone in a
window of at least WINDOW_S, opened and closed on steps of the counter while it is already
running: the energy between two steps is then its own, and the calls made in between are
counted to within one batch (BATCH_S) at either end, errors of opposite sign. The windows of
the callables take turns in ROUNDS rounds, the order changing as the timer's does, so that a
GPU warming up over the measurement is charged to each alike; each callable's figure is the
median of its windows, with their range beside it.

What it cannot fix: on the A100 and H100 the power behind the counter is sampled about a
quarter of the time (Yang et al., "Part-time Power Measurements", SC24, arXiv 2312.02741).
A callable that runs steadily for a whole window, as here, is what such sampling still
reads fairly; absolute joules are the board's sensor's, not a power meter's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol, Tuple

import torch
from dataclasses_json import dataclass_json

from ..core.errors import MeasurementFault
from .health import Nvml
from .timing import capture_graph, round_order

__all__ = ["Energy", "EnergyUnavailable", "measure_energy", "open_meter", "energy_unavailable"]

WINDOW_S = 1.0
ROUNDS = 3
# Calls are made in batches of about this long between looks at the counter and the clock.
BATCH_S = 0.01
# A counter that has not moved in this long is not being updated (NVML steps about every 100 ms).
STEP_WAIT_S = 2.0


@dataclass_json
@dataclass(frozen=True)
class Energy:
    """One callable's energy per call: the median over `windows` windows, their range, and
    the mean power over them (watts)."""

    mj_per_call: float
    low_mj: float
    high_mj: float
    watts: float
    windows: int


class EnergyUnavailable(MeasurementFault):
    """The counter cannot be read, or does not move."""


class Meter(Protocol):
    def energy_mj(self) -> float: ...


def open_meter(device: str) -> Tuple[Optional[Meter], str]:
    """The energy counter of `device`, or None and why there is none."""
    if torch.device(device).type != "cuda":
        return None, f"this run is on {torch.device(device).type}; energy is read from NVML's counter on a CUDA GPU"
    nvml = Nvml.open(device)
    if nvml is None:
        return None, "NVML cannot be opened here (pip install nvidia-ml-py, and an NVIDIA driver)"
    try:
        nvml.energy_mj()
    except Exception as e:  # noqa: BLE001  before Volta, or a driver without the counter
        return None, f"this GPU's NVML has no energy counter ({type(e).__name__}: {e})"
    return nvml, ""


def energy_unavailable(device: str) -> Optional[str]:
    """Why `--energy` cannot run on `device`; None where it can."""
    meter, why = open_meter(device)
    return None if meter is not None else why


def measure_energy(
    fns: Dict[str, Callable[[], object]],
    medians_ms: Dict[str, float],
    device: str,
    cuda_graph: bool = False,
    on_function: Optional[Callable[[str], None]] = None,
    window_s: Optional[float] = None,
    rounds: Optional[int] = None,
) -> Dict[str, Energy]:
    """Energy per call of each of `fns` (as timed: replayed from a CUDA graph with
    `cuda_graph`), whose timings `medians_ms` set the batch sizes, over `rounds` windows of at
    least `window_s` each (None: ROUNDS, WINDOW_S). Raises EnergyUnavailable."""
    window_s, rounds = window_s or WINDOW_S, rounds or ROUNDS
    meter, why = open_meter(device)
    if meter is None:
        raise EnergyUnavailable(why)
    cuda = torch.device(device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    names = list(fns)
    batches = {}
    for name in names:
        fn = capture_graph(fns[name])[0] if cuda_graph else fns[name]
        calls = max(1, round(BATCH_S / max(medians_ms[name] * 1e-3, 1e-9)))
        batches[name] = _batch(fn, calls, sync)
    windows: Dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        for name in round_order(names, r):
            if on_function is not None:
                on_function(name)
            windows[name].append(_window(batches[name], meter, window_s))
    result = {}
    for name, ws in windows.items():
        per_call = [mj / calls for mj, calls, _ in ws]
        result[name] = Energy(
            statistics.median(per_call),
            min(per_call),
            max(per_call),
            statistics.median(mj / 1e3 / s for mj, _, s in ws),
            len(ws),
        )
    return result


def _batch(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> Callable[[], int]:
    def run() -> int:
        for _ in range(calls):
            fn()
        sync()
        return calls

    return run


def _window(batch: Callable[[], int], meter: Meter, window_s: float) -> Tuple[float, int, float]:
    """(mJ, calls, seconds) between two steps of the counter, at least `window_s` apart, with
    `batch` running throughout."""
    start, _ = _until_step(batch, meter)  # the callable is running when the window opens
    opened = time.perf_counter()
    calls = 0
    while time.perf_counter() - opened < window_s:
        calls += batch()
    end, last = _until_step(batch, meter)
    seconds = time.perf_counter() - opened
    if end <= start:
        raise EnergyUnavailable(f"the energy counter went from {start} to {end} mJ over a {seconds:.2f} s window")
    return end - start, calls + last, seconds


def _until_step(batch: Callable[[], int], meter: Meter) -> Tuple[float, int]:
    """Run `batch` until the counter moves; its new reading, and the calls made meanwhile."""
    before, calls = meter.energy_mj(), 0
    started = time.perf_counter()
    while True:
        calls += batch()
        now = meter.energy_mj()
        if now != before:
            return now, calls
        if time.perf_counter() - started > STEP_WAIT_S:
            raise EnergyUnavailable(f"the energy counter did not move in {STEP_WAIT_S:.0f} s of calls")
