"""Evidence that a measurement was disturbed, gathered while sampling, so that it is acted on, not guessed.

A round of samples is *disturbed* when something outside the timed code took
the processor or slowed the device during it: on a CPU, this process's most
delayed thread spent more than 5% of the round waiting on the run queue, runnable
but not running (Linux schedstat; elsewhere, any involuntary context switch counts); on a
GPU, NVML reports a thermal or power slowdown or clocks below 75% of their
maximum. The timer throws disturbed rounds away and takes new ones within its
budget, as nvbench does with throttled samples. Across the whole measurement the
monitor also records the load that other processes put on the machine (psutil),
CPU steal time, and on a GPU other processes on the device and the temperature.

Why the run queue: with torch's default two threads on the 2-core CI machine and
one busy process beside it, 62% of 3 ms samples saw an involuntary switch, a
7.5 us Linear was timed at 7.99 ms (a scheduler time slice) and called
"converged". Counting every involuntary switch was too strict: on the idle
machine a kernel thread preempts a 60 ms round of flash_attention for
microseconds often enough that more than half the rounds were thrown away and
the point called disturbed. Time spent waiting says how much the round lost.
With the threads' waits added up and a 1% threshold, 5.9% of an idle quick run's
rounds were still called disturbed (2026-11-25): two threads on two cores wait
for every kernel thread. The loss is the most delayed thread's wait, since torch's
threads meet at the end of each parallel region, and the threshold is the 5% the
decisions' margin is made of; scripts/disturbance.py measures the false alarms
on an idle machine and the detections beside busy ones.

Timed by the measuring thread's CPU clock (timing.cpu_clock: one torch thread), a round is not
disturbed by waiting on the run queue: that clock does not run meanwhile. What it cannot see is
time the thread spent blocked, neither running nor runnable (a sleep, I/O, work handed to
another thread), so the monitor checks every round's wall time against the thread's CPU time
plus its run-queue wait; on a quiet round that is the CPU clock against wall time itself. A
measurement whose rounds were blocked beyond MAX_BLOCKED_FRACTION is not clean.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import psutil
import torch
from dataclasses_json import dataclass_json

__all__ = [
    "Health",
    "RunHealth",
    "HealthMonitor",
    "BUSY_CORES",
    "MAX_DISTURBED_FRACTION",
    "probe_load",
    "free_cores",
    "usable_cpus",
    "load_remedy",
]

# Other processes using more than this many cores on average make the machine busy:
# they share caches and memory bandwidth even when no sample was preempted.
BUSY_CORES = 0.25
# When more than this fraction of the rounds was disturbed, the clean rounds that remain
# are a selection from a bad time, not a measurement of the normal one.
MAX_DISTURBED_FRACTION = 0.5
# A CPU round is disturbed when its most delayed thread waited this fraction of it on the run queue.
MAX_LOST_FRACTION = 0.05
# Timed by the CPU clock, a measurement whose median round was blocked (neither running nor
# waiting for a CPU) for more than this fraction is not clean: the clock missed that much of it.
MAX_BLOCKED_FRACTION = 0.02
_SCHEDSTAT = "/proc/self/task"
# NVML clock-event reasons that mean the GPU slowed itself down (nvml.h values):
# HW slowdown, SW thermal, HW thermal, HW power brake. Idle and the SW power cap are not.
_GPU_SLOWDOWNS = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}
_MIN_CLOCK_RATIO = 0.75


@dataclass_json
@dataclass(frozen=True)
class Health:
    """What the machine did while one point's timings were taken.

    rounds / disturbed_rounds: rounds kept, and rounds thrown away and retaken.
    other_load_cores: cores used on average by other processes (None on a GPU run).
    steal: fraction of the CPU time the hypervisor gave to other machines.
    gpu_*: NVML's view (None without NVML).
    cleaned: False when too few rounds escaped disturbance: the timings are then the
        disturbed ones, and no verdict is drawn from them.
    problems: why this measurement is not clean; empty when it is.
    """

    rounds: int
    disturbed_rounds: int
    cleaned: bool = True
    other_load_cores: Optional[float] = None
    cores: int = 0
    steal: Optional[float] = None
    # CPU clock at the end against its maximum; None where the OS does not say (VMs often report no maximum).
    cpu_freq_ratio: Optional[float] = None
    gpu_slowdowns: List[str] = field(default_factory=list)
    gpu_other_processes: Optional[int] = None
    gpu_min_clock_ratio: Optional[float] = None
    gpu_max_temperature_c: Optional[float] = None
    # Recorded, not judged: no measurement here has yet tied a verdict to them.
    gpu_min_memory_clock_ratio: Optional[float] = None
    # NVML's power reading is an average over about a second (Ampere and later), so this is
    # the highest such average seen, not a peak.
    gpu_max_power_w: Optional[float] = None
    problems: List[str] = field(default_factory=list)
    # Timed by the CPU clock: the median round's fraction that the measuring thread spent blocked
    # (wall time less its CPU time and its run-queue wait); None under wall time or without schedstat.
    blocked: Optional[float] = None

    @property
    def clean(self) -> bool:
        return not self.problems


@dataclass_json
@dataclass(frozen=True)
class RunHealth:
    """The machine over a whole run: its points' `Health` added up."""

    points: int
    points_with_problems: int
    rounds: int
    disturbed_rounds: int
    max_other_load_cores: Optional[float] = None
    gpu_slowdowns: List[str] = field(default_factory=list)

    @classmethod
    def of(cls, healths: List[Health]) -> "RunHealth":
        loads = [h.other_load_cores for h in healths if h.other_load_cores is not None]
        return cls(
            points=len(healths),
            points_with_problems=sum(not h.clean for h in healths),
            rounds=sum(h.rounds for h in healths),
            disturbed_rounds=sum(h.disturbed_rounds for h in healths),
            max_other_load_cores=max(loads) if loads else None,
            gpu_slowdowns=sorted({s for h in healths for s in h.gpu_slowdowns}),
        )


class HealthMonitor:
    """Watches one measurement: `round_started()` / `round_disturbed()` around each round, `finish()` at the end."""

    def __init__(self, device: str, cpu_clock: bool = False):
        self.cuda = torch.device(device).type == "cuda"
        self.cpu_clock = cpu_clock
        self._tid = threading.get_native_id()
        self._thread0 = (0.0, 0.0)
        self._blocked: List[float] = []
        self.gpu = Nvml.open(device) if self.cuda else None
        self._wall0 = time.monotonic()
        self._cpu0 = psutil.cpu_times()
        self._usable0 = _usable_busy_s()
        self._own0 = _own_cpu_s()
        self._switches = 0
        self._waited: Dict[str, float] = {}
        self._round_started = 0.0
        self.slowdowns: List[str] = []
        self.min_clock_ratio: Optional[float] = None
        self.max_temperature: Optional[float] = None
        self.min_memory_clock_ratio: Optional[float] = None
        self.max_power: Optional[float] = None

    def round_started(self) -> None:
        if self.cpu_clock:  # only the measuring thread's wait is read: one file, not every thread's
            self._thread0 = (time.thread_time(), _thread_wait_s(self._tid))
        else:
            self._switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
            self._waited = _run_queue_waits_s() or {}
        self._round_started = time.perf_counter()

    def round_lost(self) -> Optional[float]:
        """The fraction of the round since `round_started` that this process's most delayed
        thread spent runnable but not running; None where Linux schedstat is not there.

        The most delayed thread, not the sum over threads: torch's threads meet at the end of
        every parallel region, so a round loses what its slowest thread waited, and two
        threads each waiting the same microseconds lose them once, not twice."""
        waited = _run_queue_waits_s()
        if waited is None:
            return None
        lost = max((w - self._waited.get(tid, 0.0) for tid, w in waited.items()), default=0.0)
        return lost / max(time.perf_counter() - self._round_started, 1e-9)

    def round_disturbed(self) -> bool:
        """Whether the round since `round_started` was disturbed; called once per round."""
        if self.cpu_clock:
            self._check_cpu_clock()
            return False
        lost = self.round_lost()
        if lost is None:  # no schedstat: any preemption counts
            disturbed = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw > self._switches
        else:
            disturbed = lost > MAX_LOST_FRACTION
        if self.gpu is not None:
            now = self.gpu.read()
            self.slowdowns += [s for s in now.slowdowns if s not in self.slowdowns]
            self.min_clock_ratio = _extreme(min, self.min_clock_ratio, now.sm_clock_ratio)
            self.min_memory_clock_ratio = _extreme(min, self.min_memory_clock_ratio, now.memory_clock_ratio)
            self.max_temperature = _extreme(max, self.max_temperature, now.temperature_c)
            self.max_power = _extreme(max, self.max_power, now.power_w)
            # On a GPU the CPU only launches: a preempted launcher shows in the sample as
            # launch overhead, so it counts, and so does a slowed-down device.
            disturbed = disturbed or bool(now.slowdowns) or now.sm_clock_ratio < _MIN_CLOCK_RATIO
        return disturbed

    def _check_cpu_clock(self) -> None:
        """Record the fraction of the round the measuring thread spent blocked (see the module's doc)."""
        wall = max(time.perf_counter() - self._round_started, 1e-9)
        cpu = time.thread_time() - self._thread0[0]
        wait = _thread_wait_s(self._tid) - self._thread0[1]
        if not math.isnan(wait):  # schedstat is there (Linux)
            self._blocked.append(max(0.0, wall - cpu - wait) / wall)

    def seconds(self) -> float:
        """Seconds since the monitor started."""
        return time.monotonic() - self._wall0

    def other_load(self) -> float:
        """Cores other processes have used on average since the monitor started."""
        wall = max(self.seconds(), 1e-9)
        busy = _usable_busy_s() - self._usable0
        return max(0.0, busy - (_own_cpu_s() - self._own0)) / wall

    def busy(self) -> bool:
        """Whether other processes have been using more than BUSY_CORES so far."""
        return self.other_load() > BUSY_CORES

    def finish(self, rounds: int, disturbed_rounds: int, min_rounds: int = 1) -> Health:
        """What was seen; `rounds` clean ones were kept and fewer than `min_rounds` cannot be cleaned."""
        cpu1 = psutil.cpu_times()
        cores = len(usable_cpus())
        other = self.other_load()
        total = sum(cpu1) - sum(self._cpu0)
        steal = (getattr(cpu1, "steal", 0.0) - getattr(self._cpu0, "steal", 0.0)) / total if total > 0 else 0.0
        problems = []
        seen = rounds + disturbed_rounds
        cleaned = rounds >= min_rounds and disturbed_rounds <= MAX_DISTURBED_FRACTION * seen
        blocked = statistics.median(self._blocked) if self._blocked else None
        if blocked is not None and blocked > MAX_BLOCKED_FRACTION:
            cleaned = False
            problems.append(
                f"disturbed: timed by the CPU clock, but the median round spent {blocked:.0%} blocked (asleep, or "
                "waiting on work elsewhere), which that clock does not count; --clock wall times it"
            )
        if not cleaned and not problems:
            # Threads that wait for each other each need a core: with one busy process beside
            # them, two threads on two cores spend samples waiting for a time slice.
            hint = (
                "; fewer --threads than free cores avoids this" if not self.cuda and torch.get_num_threads() > 1 else ""
            )
            problems.append(
                f"disturbed: {disturbed_rounds} of {seen} rounds waited for a CPU or were throttled{hint}"
            )
        if other > BUSY_CORES:
            problems.append(f"busy machine: other processes used {other:.2f} of {cores} cores")
        if steal > 0.05:
            problems.append(f"steal: the hypervisor took {steal:.0%} of the CPU time")
        gpu_others = None if self.gpu is None else self.gpu.other_processes()
        if self.slowdowns:
            problems.append(f"throttled: {', '.join(self.slowdowns)}")
        if gpu_others:
            problems.append(f"busy GPU: {gpu_others} other process(es) on the device")
        return Health(
            rounds=rounds,
            disturbed_rounds=disturbed_rounds,
            cleaned=cleaned,
            other_load_cores=round(other, 3),
            cores=cores,
            steal=round(steal, 4),
            cpu_freq_ratio=None if self.cuda else _cpu_freq_ratio(),
            gpu_slowdowns=list(self.slowdowns),
            gpu_other_processes=gpu_others,
            gpu_min_clock_ratio=self.min_clock_ratio,
            gpu_max_temperature_c=self.max_temperature,
            gpu_min_memory_clock_ratio=self.min_memory_clock_ratio,
            gpu_max_power_w=self.max_power,
            problems=problems,
            blocked=None if blocked is None else round(blocked, 4),
        )


def probe_load(since: Optional[HealthMonitor] = None, seconds: float = 0.2) -> float:
    """Cores other processes use, over at least `seconds`: asked before a run measures, so that a
    busy machine is named in a second, not after ten minutes of DISTURBED points (issue 48: 15 min,
    14 of 18 ops disturbed, the remedy printed on every row at the end). Between ops, over the time
    `since` a monitor began (the op that just ended), waiting only where that was shorter: a sleep
    of its own between every two ops cost 3.6 s of the quick preset of all ops (2-core CPU, 2026-11-27)."""
    monitor = since or HealthMonitor("cpu")
    time.sleep(max(0.0, seconds - monitor.seconds()))
    return monitor.other_load()


def free_cores(other: float) -> int:
    """The cores left to a run while other processes use `other` of them (0: none): a core counts
    as busy once its share of the load exceeds BUSY_CORES."""
    return max(0, len(usable_cpus()) - max(0, math.ceil(other - BUSY_CORES)))


def load_remedy(other: float) -> str:
    """What measures cleanly beside `other` cores of load, for a message. With every core busy,
    only one thread timed by its CPU clock does (timing.cpu_clock): beside two busy loops on the
    2 cores, one thread timed by wall time still had 17 of 18 ops DISTURBED."""
    free = free_cores(other)
    if free:
        return f"--threads {free} (or --threads auto) measures cleanly"
    return "no core is free: --threads 1 is timed by its CPU clock, which that load does not stretch"


def _extreme(pick: Callable[[float, float], float], seen: Optional[float], now: Optional[float]) -> Optional[float]:
    """pick(seen, now), skipping either where it is None (nothing seen yet, or no reading)."""
    if seen is None or now is None:
        return now if seen is None else seen
    return pick(seen, now)


def _run_queue_waits_s() -> Optional[Dict[str, float]]:
    """Seconds each thread of this process has waited on the run queue (Linux schedstat), by
    thread id; None elsewhere."""
    try:
        threads = os.listdir(_SCHEDSTAT)
    except OSError:
        return None
    waits = {tid: _thread_wait_s(tid) for tid in threads}
    return {tid: w for tid, w in waits.items() if not math.isnan(w)}


def _thread_wait_s(tid: object) -> float:
    """Seconds thread `tid` of this process has waited on the run queue; NaN where schedstat is
    not there or the thread has just ended."""
    try:
        with open(f"{_SCHEDSTAT}/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return math.nan


def _cpu_freq_ratio() -> Optional[float]:
    try:
        freq = psutil.cpu_freq()
    except Exception:  # noqa: BLE001  not reported on this platform
        return None
    return round(freq.current / freq.max, 3) if freq is not None and freq.max > 0 else None


def usable_cpus() -> List[int]:
    """The CPUs this process may run on (taskset's), where the system says; else all of them.
    Counted over all, a run under `taskset -c 0` beside a loop on its one CPU was told the
    machine had a core free, and took two threads."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(psutil.cpu_count() or 1))


def _usable_busy_s() -> float:
    """Busy seconds of the CPUs this process may run on, since boot."""
    per_cpu = psutil.cpu_times(percpu=True)
    return sum(_busy_s(per_cpu[i]) for i in usable_cpus() if i < len(per_cpu))


def _busy_s(times: Any) -> float:
    # Everything but idle and iowait; steal is time this VM wanted and did not get.
    return sum(times) - times.idle - getattr(times, "iowait", 0.0) - getattr(times, "steal", 0.0)


def _own_cpu_s() -> float:
    """CPU seconds of this process and its children, the live ones too: torch.compile's worker
    processes are ours, and on an H100 run their 1.03 cores made the machine look busy."""
    t = os.times()
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        live += c.user + c.system
    return t.user + t.system + t.children_user + t.children_system + live


class GpuReading(NamedTuple):
    """One look at the GPU (Nvml.read): clocks as fractions of their maximum."""

    slowdowns: List[str]
    sm_clock_ratio: float
    memory_clock_ratio: float
    temperature_c: float
    power_w: Optional[float]


class Nvml:
    """The few NVML readings the monitor needs, for one device; None where NVML is absent."""

    def __init__(self, nvml: Any, handle: Any):
        self.nvml, self.handle = nvml, handle
        self.max_sm_clock = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)
        self.max_memory_clock = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)

    @classmethod
    def open(cls, device: str) -> Optional["Nvml"]:
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
            # NVML numbers devices its own way (CUDA_VISIBLE_DEVICES renumbers them for torch);
            # the UUID names the same device in both.
            uuid = torch.cuda.get_device_properties(index).uuid
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}"))
        except Exception:  # noqa: BLE001  no driver, no permission, an old torch without uuid
            return None

    def read(self) -> GpuReading:
        n = self.nvml
        # Renamed "event reasons" in newer NVML; the bits are the same.
        get_reasons = (
            getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        reasons = get_reasons(self.handle)
        sm_clock = n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM)
        memory_clock = n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_MEM)
        try:
            power_w: Optional[float] = n.nvmlDeviceGetPowerUsage(self.handle) / 1e3  # milliwatts
        except Exception:  # noqa: BLE001  not every board reports it
            power_w = None
        return GpuReading(
            [name for bit, name in _GPU_SLOWDOWNS.items() if reasons & bit],
            sm_clock / self.max_sm_clock if self.max_sm_clock else 1.0,
            memory_clock / self.max_memory_clock if self.max_memory_clock else 1.0,
            float(n.nvmlDeviceGetTemperature(self.handle, n.NVML_TEMPERATURE_GPU)),
            power_w,
        )

    def energy_mj(self) -> float:
        """The board's energy since the driver loaded, in mJ (Volta and later; measurement.energy reads it)."""
        return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def facts(self) -> Dict[str, Any]:
        """What the run manifest records of the GPU: driver, clocks now and at most."""
        n = self.nvml
        return {
            "driver": n.nvmlSystemGetDriverVersion(),
            "sm_clock_mhz": n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM),
            "max_sm_clock_mhz": self.max_sm_clock,
            "memory_clock_mhz": n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_MEM),
            "max_memory_clock_mhz": self.max_memory_clock,
        }

    def other_processes(self) -> int:
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:  # noqa: BLE001  not supported on this device or driver
            return 0
        return sum(p.pid != os.getpid() for p in procs)
