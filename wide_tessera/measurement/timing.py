"""Timers that adapt to noise: samples are taken until the median is known well enough.

CPU: a clock around a calibrated loop of calls: with one torch thread, that thread's CPU clock
(see cpu_clock), else perf_counter. CUDA: CUDA events around a calibrated loop, the L2 flushed
before every sample. One timer per device, alone or paired,
so every setting of TimingConfig means the same everywhere (scripts/timer_fidelity.py holds
the CUDA timer against triton's do_bench). Several functions are timed in interleaved
rounds (A B C A B C ...), so drift in the machine's speed hits all of them alike and their
samples pair up by round.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Tuple, TypeVar

import torch
from dataclasses_json import dataclass_json

from ..core.errors import MeasurementFault, WideTesseraError, one_line
from ..core.stats import TimingStats, median_ci_rel_width
from ..core.user_input import check_bool, check_number
from .health import Health, HealthMonitor
from .traces import nvtx_range

__all__ = [
    "TimingConfig",
    "TimedFunctionError",
    "NotCapturable",
    "PairedTimings",
    "measure",
    "measure_paired",
    "once_s",
    "StopRule",
    "Look",
    "timer_name",
    "cpu_clock",
    "CLOCKS",
    "capture_graph",
]

# auto: the CPU clock where it sees all the work (cpu_clock), wall time elsewhere; wall: always perf_counter.
CLOCKS = ("auto", "wall")

# How many budgets a decision may spend to reach its first look (see _look); the stage's time
# limit still bounds it.
_FIRST_LOOK_BUDGETS = 10

# An L2 flush buffer larger than any current GPU's L2 (H100: 50 MB, H200: 60 MB).
_L2_FLUSH_BYTES = 256 * 1024 * 1024

Fn = Callable[[], object]
T = TypeVar("T")
StageContext = Callable[[str], ContextManager[None]]


class TimedFunctionError(MeasurementFault):
    """One of the timed functions raised (or timed out); `name` says which."""

    def __init__(self, name: str, error: Exception):
        super().__init__(f"{name}: {type(error).__name__}: {error}")
        self.name, self.error = name, error


class NotCapturable(MeasurementFault):
    """A function that runs, but not inside a CUDA graph: a limit of the function, not a fault.

    On an H100 (torch 2.11) torch._grouped_mm in float32 copies its offsets to the host, and
    transformers' grouped_mm experts with it: under --cuda-graph their points were reported
    as errors, 'incorrect' in the summary, though they had computed nothing wrong.
    """


@dataclass_json
@dataclass(frozen=True)
class TimingConfig:
    """When to stop sampling: the median's 95% CI is narrow enough, or the time budget is spent."""

    # Each function runs for at least this long before its first sample (the samplers' prepare).
    # Not less, though a point's functions have run in its checks and each CPU sample starts with
    # an untimed call: with 5 ms, scripts/coverage.py's 0.5x pair (one Linear 512 against two)
    # leaned +1.8% and +2.1% (bias intervals excluding zero), against -0.3% with 25 ms in the
    # same session (pinned, 2026-11-27); 5 ms would have saved 10 s of a 95 s quick run.
    warmup_s: float = 0.025
    # Time budget per function; a paired measurement of k functions gets k budgets.
    budget_s: float = 0.5
    min_samples: int = 10
    max_samples: int = 1000
    # Stop once the 95% CI of every median is narrower than this fraction of it.
    target_rel_ci: float = 0.02
    # A sample runs the function in a loop for at least this long: on a CPU so that
    # perf_counter's own cost (well under a microsecond) stays below 0.1% of it, on a GPU
    # so that launch jitter averages out (see _CudaSampler.prepare).
    min_sample_s: float = 1e-3
    # CUDA only: capture each function in a CUDA graph and time its replay,
    # which removes kernel-launch overhead from every side.
    cuda_graph: bool = False
    # CPU only: which clock times a sample (CLOCKS; see cpu_clock).
    clock: str = "auto"

    def __post_init__(self) -> None:
        # Upper bounds catch typos: an hour of sampling per function or a million samples is never meant.
        check_number("warmup_s", self.warmup_s, 0, 3600, low_ok=True, what="a number of seconds")
        check_number("budget_s", self.budget_s, 0, 3600, what="a number of seconds")
        # A median's uncertainty needs at least 2 samples.
        check_number("min_samples", self.min_samples, 2, 10**6, integer=True, low_ok=True)
        check_number("max_samples", self.max_samples, self.min_samples, 10**6, integer=True, low_ok=True)
        check_number("target_rel_ci", self.target_rel_ci, 0, 1, high_ok=False, what="a fraction")
        check_number("min_sample_s", self.min_sample_s, 0, 1, low_ok=True, what="a number of seconds")
        check_bool("cuda_graph", self.cuda_graph)
        if self.clock not in CLOCKS:
            raise WideTesseraError(f"clock={self.clock!r}: give one of {', '.join(CLOCKS)}")


def once_s(call: Callable[[], object], device: str) -> float:
    """Seconds one call of `call` takes on `device`, to its end: on a GPU the device is synchronized
    before and after, or the call would be timed to its launch (a first call's one-call estimate
    once judged its time bound so). For a compiled callable's first call, its compilation."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    call()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(fn: Fn, device: str = "cpu", config: Optional[TimingConfig] = None) -> TimingStats:
    """Time `fn()` on `device`; every sample (ms per call) is kept with its statistics.

    The paired timer with one function: triton's do_bench, which `measure` once handed CUDA
    functions to, ignores min_samples, max_samples, target_rel_ci and min_sample_s.
    """
    return measure_paired({"fn": fn}, device, config).stats["fn"]


@dataclass(frozen=True)
class PairedTimings:
    """What `measure_paired` found: each function's statistics, what the machine did meanwhile,
    and how many seconds the sampling took (warm-up excluded) on the samples' clock, against its budget."""

    stats: Dict[str, TimingStats]
    health: Health
    sampled_s: float = 0.0


class Look(NamedTuple):
    """What a stop rule says after a round: stop now; or go on without the functions in `drop`
    (their samples so far are kept: rounds pair by index, so a function dropped after k rounds
    pairs with the first k of the others)."""

    stop: bool
    drop: FrozenSet[str] = frozenset()


# stop(clean samples by function) -> Look; see measure_paired.
StopRule = Callable[[Dict[str, List[float]]], Look]


def measure_paired(
    fns: Dict[str, Fn],
    device: str = "cpu",
    config: Optional[TimingConfig] = None,
    stage: Optional[StageContext] = None,
    on_function: Optional[Callable[[str], None]] = None,
    stop: Optional[StopRule] = None,
    extra_budget_s: float = 0.0,
    label: Optional[Callable[[str], str]] = None,
) -> PairedTimings:
    """Time several functions in interleaved rounds; sample i of each comes from round i.

    The order changes from round to round (`round_order`, a Williams design), so whatever
    happens between rounds (the convergence test, the health check) precedes each function
    equally often, and so does each other function; a test that always preceded the
    baseline biased speedups by 1.5 to 3% in the fused strategy's favour. Rounds the health monitor
    finds disturbed are thrown away and retaken while the budget lasts.

    `stage(name)` wraps the 'warmup' and 'measure' phases (the runner puts time limits
    there). `on_function(name)` hears which function is about to run, before its warm-up
    and each of its samples (the isolated worker records it, so that a crash or a hang
    is charged to the function that caused it). A function that raises, or that is running
    when the stage's time runs out, is reported as TimedFunctionError naming it.

    When to stop is one rule with two forms, both capped by the budget (config.budget_s per
    function, plus `extra_budget_s`): without `stop`, once every median's 95% CI is narrower
    than config.target_rel_ci (precise times); with it, as soon as `stop(clean samples)` says
    so after a round (results.decisions: when the point's decisions are settled), its
    medians' precision then being whatever the decision needed. The rule may also drop
    functions whose part it has settled (a strategy known slower than another): later rounds
    leave them out, which on moe_experts' quick sweep saved the padded strategy's 19 ms per call.
    The first function (the baseline) is never dropped. On CUDA, with `label`, every sample
    is an NVTX range named label(function) (measurement.traces).
    """
    on_function = on_function or (lambda name: None)
    config = config or TimingConfig()
    stage = stage or (lambda name: nullcontext())
    names = list(fns)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    positions: Dict[str, List[int]] = {name: [] for name in names}
    disturbed: Dict[str, List[float]] = {name: [] for name in names}
    disturbed_positions: Dict[str, List[int]] = {name: [] for name in names}
    active = list(names)
    with _gc_paused():
        with stage("warmup"):
            sampler = _CudaSampler(config) if torch.device(device).type == "cuda" else _CpuSampler(config)
            for name, fn in fns.items():
                on_function(name)
                _blamed(name, sampler.prepare, name, fn)
        with stage("measure"):
            monitor = HealthMonitor(device, cpu_clock(device, config))
            # The budget is spent on the samples' clock: on the CPU clock a loaded machine buys
            # the rounds a quiet one would, at the wall time its load costs.
            started = sampler.clock()
            budget = config.budget_s * len(fns) + extra_budget_s
            for r in itertools.count():
                order = round_order(active, r)
                monitor.round_started()
                taken = {}
                for name in order:
                    on_function(name)
                    with nvtx_range(label(name), device) if label else nullcontext():
                        taken[name] = _blamed(name, sampler.sample, name)
                clean = not monitor.round_disturbed()
                for name in active:
                    (samples if clean else disturbed)[name].append(taken[name])
                    (positions if clean else disturbed_positions)[name].append(order.index(name))
                look = _look(samples, disturbed, config, sampler.clock() - started, budget, stop, monitor)
                if look.stop:
                    break
                active = [name for name in active if name == names[0] or name not in look.drop]
            sampled_s = sampler.clock() - started
    health = monitor.finish(len(samples[names[0]]), len(disturbed[names[0]]), config.min_samples)
    kept = _kept(samples, positions, disturbed, disturbed_positions, config.min_samples)
    timer = timer_name(device, config)
    # Sampling for a decision asks no precision of a median, so none is missing.
    stats = {
        name: TimingStats.from_samples(s, timer, sampler.calls[name], stop is not None or _narrow(s, config), at)
        for name, (s, at) in kept.items()
    }
    return PairedTimings(stats, health, sampled_s)


def _kept(
    clean: Dict[str, List[float]],
    clean_at: Dict[str, List[int]],
    disturbed: Dict[str, List[float]],
    disturbed_at: Dict[str, List[int]],
    min_samples: int,
) -> Dict[str, Tuple[List[float], List[int]]]:
    """Each function's samples and their positions in their rounds: the clean rounds', or, with
    too few clean rounds to say anything, every round's (the health record flags it)."""
    first = next(iter(clean))
    if len(clean[first]) >= min_samples:
        return {name: (clean[name], clean_at[name]) for name in clean}
    return {name: (clean[name] + disturbed[name], clean_at[name] + disturbed_at[name]) for name in clean}


def _blamed(name: str, call: Callable[..., T], *args: object) -> T:
    """`call(*args)`, its exception charged to function `name`. Only a function's own preparation
    and samples are blamed on it: a fault of the health monitor or of the stop rule is ours, and
    passes up as it is, not as one more failure of whichever strategy was sampled last."""
    try:
        return call(*args)
    except Exception as e:
        raise TimedFunctionError(name, e) from e


def round_order(names: List[str], r: int) -> List[str]:
    """Round r's order (see measure_paired): row r of a Williams design, a Latin square whose
    rows (k of them for k names, 2k for an odd k, the second k reversed) start with each name
    equally often and put each name right after every other equally often.

    A rotation (ABC, BCA, CAB) started each name equally often but always put a name after the
    same neighbour: after batched_mm's 67 MB weight gathers, the strategy timed next measured
    0.88x of the very grouped_mm it ran (hf_experts on the 2-core CPU, 2026-11-25)."""
    k = len(names)
    first = [0] + [(i + 1) // 2 if i % 2 else k - i // 2 for i in range(1, k)]  # 0 1 k-1 2 k-2 ...
    order = [names[(x + r) % k] for x in first]
    return order[::-1] if k % 2 and (r // k) % 2 else order


def _look(
    clean: Dict[str, List[float]],
    disturbed: Dict[str, List[float]],
    config: TimingConfig,
    elapsed: float,
    budget: float,
    stop: Optional[StopRule],
    monitor: Optional[HealthMonitor] = None,
) -> Look:
    """Stop when `stop` says so (without one: when every median is narrow enough), at
    max_samples, or when the budget is spent; `stop` may drop functions meanwhile.

    Past the budget, rounds go on (up to twice the budget; for a decision, ten times) only to
    reach min_samples clean ones; min_samples rounds, clean or not, are always taken.
    """
    first = next(iter(clean))  # the baseline, sampled in every round
    rounds, n_disturbed = len(clean[first]), len(disturbed[first])
    if rounds >= config.max_samples or n_disturbed >= config.max_samples:
        return Look(True)
    if rounds < config.min_samples:
        # A decision's first look needs min_samples clean rounds, whatever one round costs: a
        # point of 20 ms calls used its 0.25 s budgets in 6 rounds and was judged on none
        # (moe_experts at N=32). Precise times keep the old bound, twice the budget, and so do
        # rounds mostly disturbed: there time buys no clean rounds. (Beside one busy process,
        # torch's two threads on the 2-core machine had nearly every quick point disturbed; each
        # spent its ten budgets and ended DISTURBED all the same, 20 minutes for the preset.)
        slow_but_clean = stop is not None and n_disturbed <= rounds
        limit = (_FIRST_LOOK_BUDGETS if slow_but_clean else 2) * budget
        return Look(elapsed > limit and rounds + n_disturbed >= config.min_samples)
    if stop is not None:
        look = stop(clean)
        if elapsed > budget:
            return Look(True)
        # Disturbed rounds mark a transient, and the clean rounds beside it may share it: such
        # a measurement, or one taken while other processes keep the machine busy, stops early
        # only on twice the minimum of clean rounds. (A groupnorm point with 2 disturbed rounds
        # settled 'loop' at 0.94x on its first 10; measured again, it was 1.16x [1.08, 1.24].
        # An A/A twin beside one busy process was once called faster on its first 10.)
        early = look.stop and rounds < 2 * config.min_samples
        if early and (n_disturbed or (monitor is not None and monitor.busy())):
            return Look(False, look.drop)
        return look
    return Look(elapsed > budget or all(_narrow(s, config) for s in clean.values()))


def timer_name(device: str, config: TimingConfig) -> str:
    """The timer `measure_paired` uses on `device` with `config`, with torch's threads as they are now."""
    if torch.device(device).type != "cuda":
        return "cpu_thread_time" if cpu_clock(device, config) else "cpu_perf_counter"
    return "cuda_graph_event" if config.cuda_graph else "cuda_event"


def cpu_clock(device: str, config: TimingConfig) -> bool:
    """Whether samples are timed by the measuring thread's CPU clock (time.thread_time): on a CPU
    with one torch thread, unless config.clock says wall.

    Other processes stretch wall time by the time slices they take; the CPU clock counts only
    the slices the measuring thread ran. gemm N=16 against bmm, one thread pinned to one core,
    30 paired blocks: quiet, wall 1.217x [1.072, 1.758] and CPU 1.214x [1.128, 1.375]; beside
    two busy loops on that core, wall 1.315x and CPU 1.232x. With one torch thread that thread
    does all of torch's work; with more, the others' work (and their waits for each other) is
    not on its clock, so wall time and the disturbance detector stay. What the CPU clock cannot
    see, a function that sleeps or waits on work elsewhere, HealthMonitor checks every round
    (Health.blocked)."""
    return torch.device(device).type == "cpu" and config.clock == "auto" and torch.get_num_threads() == 1


def _narrow(samples: List[float], config: TimingConfig) -> bool:
    return median_ci_rel_width(samples) <= config.target_rel_ci


@contextmanager
def _gc_paused() -> Iterator[None]:
    # A collection in the middle of a sample would be charged to whichever function ran then.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Sampler:
    """Warms up and samples functions by name; `calls[name]` is the calls per sample."""

    def __init__(self, config: TimingConfig):
        self.config = config
        self.clock: Callable[[], float] = time.perf_counter  # what a sample is timed by, in seconds
        self.fns: Dict[str, Fn] = {}
        self.calls: Dict[str, int] = {}

    def prepare(self, name: str, fn: Fn) -> None:
        """Warm `fn` up and get it ready to be sampled as `name`."""
        raise NotImplementedError

    def sample(self, name: str) -> float:
        """One sample of function `name`, in ms per call."""
        raise NotImplementedError


# glibc raises its mmap threshold to the size of any mmap'd block that is freed, up to
# 32 MiB. Below the threshold, tensors come from the heap; above it, every allocation is
# a fresh mmap that page-faults on first touch. So a timing depended on what the process
# had freed before: 32 conv1d calls took 28 ms, or 17 ms once a larger conv had run
# (2-core CI machine). Freeing one block just under the cap pins the threshold at its
# ceiling, the state a long-running process settles in, and no later free can move it.
_SETTLE_BYTES = 31 * 1024 * 1024


def _settle_allocator() -> None:
    block = torch.empty(_SETTLE_BYTES, dtype=torch.uint8)
    del block


class _CpuSampler(_Sampler):
    def __init__(self, config: TimingConfig):
        super().__init__(config)
        self.clock = time.thread_time if cpu_clock("cpu", config) else time.perf_counter
        _settle_allocator()

    def prepare(self, name: str, fn: Fn) -> None:
        """Double the loop until one sample lasts long enough; this also warms up.

        Each length is judged by the median of three timings, so one preempted moment
        cannot settle the calls per sample: on a busy machine one 16 ms time slice once
        left a baseline at 1 call per sample and its strategy at 64.
        """
        calls = 1
        warm_until = time.perf_counter() + self.config.warmup_s
        while True:
            elapsed = statistics.median(_loop_s(fn, calls, self.clock) for _ in range(3))
            if elapsed >= self.config.min_sample_s and time.perf_counter() >= warm_until:
                break
            if elapsed < self.config.min_sample_s:
                calls *= 2
        self.fns[name], self.calls[name] = fn, calls

    def sample(self, name: str) -> float:
        """One untimed call, then the timed loop: the sample starts with this function's data in
        the caches, whatever ran before it. Without it, a 512x512 Linear timed against two
        (1 MB of weights each) came out 2.2% slower relative to them than in long
        blocked_autorange runs (scripts/coverage.py), because each sample began cold after the
        other function; the order of the round leaked into the speedup."""
        fn, calls = self.fns[name], self.calls[name]
        fn()
        return _loop_s(fn, calls, self.clock) * 1e3 / calls


def _loop_s(fn: Fn, calls: int, clock: Callable[[], float]) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return clock() - t0


class _CudaSampler(_Sampler):
    def __init__(self, config: TimingConfig):
        super().__init__(config)
        self.flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")

    def prepare(self, name: str, fn: Fn) -> None:
        """Warm up, then double the calls per sample until a sample lasts min_sample_s.

        One call per sample left launch-bound points unconverged: on an H100 a 16x256x256
        Linear took 0.1 ms a call with a coefficient of variation near 20% (host launch
        jitter), and 570 rounds in the 1.5 s budget still gave a 4% wide interval, so 66
        of 79 gemm points of the quick preset ran out their budget. Calls after the first
        in a sample queue behind it as they would in a model's loop; the L2 is flushed
        before each sample, so a call of 1 ms or more still starts cold every time.
        """
        fn = capture_graph(fn)[0] if self.config.cuda_graph else fn
        warm_until = time.perf_counter() + self.config.warmup_s
        while True:  # at least once, then until the warm-up time is spent
            fn()
            torch.cuda.synchronize()
            if time.perf_counter() >= warm_until:
                break
        self.fns[name], self.calls[name] = fn, 1
        while statistics.median(self._timed(name) for _ in range(3)) * 1e-3 < self.config.min_sample_s:
            self.calls[name] *= 2

    def sample(self, name: str) -> float:
        return self._timed(name) / self.calls[name]

    def _timed(self, name: str) -> float:
        """ms for one sample's loop of calls."""
        fn = self.fns[name]
        self.flush.zero_()  # outside the timed region: every sample starts with a cold L2
        # Wait for the flush, so the timed region starts on an idle GPU and includes the
        # CPU's launch overhead: N separate calls pay it N times, and fusion saves it.
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.calls[name]):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))


def capture_graph(fn: Callable[[], T]) -> Tuple[Fn, T]:
    """`fn` captured once in a CUDA graph: the replay, and what the captured call returned
    (tensors that each replay overwrites in place); NotCapturable if it runs but cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up outside the graph, as capture requires
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    refused: List[BaseException] = []
    try:
        with torch.cuda.graph(graph):
            try:
                output = fn()
            except Exception as e:  # noqa: BLE001  it ran three times above: capture refused it
                refused.append(e)
                raise
    except Exception as e:  # noqa: BLE001
        if not refused:  # the device's own error (an asynchronous one of the warm-up, memory): not a limit
            raise
        raise NotCapturable(f"cannot be captured in a CUDA graph ({one_line(refused[0])[:200]})") from e
    return graph.replay, output
