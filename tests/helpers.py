"""What several test modules share: fake ops and models, and the fast timing. Test modules
import from here, never from each other."""

import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

from wide_tessera import SweepParams, TimingConfig
from wide_tessera.core.environment import cpu_name
from wide_tessera.dispatch.table import DispatchEntry, NVerdict
from wide_tessera.ops import WideLinear
from wide_tessera.results.analysis import group_crossover

# Timing is not under test in most tests: sample briefly so the suite stays fast.
FAST = TimingConfig(warmup_s=0.0, budget_s=0.005, min_samples=3, min_sample_s=1e-4)


class Expert(nn.Module):
    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class SometimesWrongLinear(WideLinear):
    """WideLinear plus two broken strategies: one fast and wrong, one that raises."""

    BENCHMARK_STRATEGIES = ("bmm", "wrong", "raises")
    BENCHMARK_SWEEPS = {"test": SweepParams.of([1, 2, 4], batch=[4], in_features=[8], out_features=[8])}

    def forward(self, x):
        if self.strategy == "wrong":
            return torch.zeros(self.n, *x.shape[1:-1], self.out_features)  # far faster than any real strategy
        if self.strategy == "raises":
            raise RuntimeError("kernel exploded")
        return super().forward(x)


class TroubleLinear(WideLinear):
    """A healthy strategy next to every way a strategy can go wrong."""

    BENCHMARK_STRATEGIES = ("bmm", "hangs", "segfaults", "oom", "wrong")
    BENCHMARK_SWEEPS = {"test": SweepParams.of([2], batch=[4], in_features=[8], out_features=[8])}

    def forward(self, x):
        if self.strategy == "hangs":
            signal.signal(signal.SIGALRM, signal.SIG_IGN)  # deaf to the worker's own alarm: only a kill stops it
            while True:
                pass
        if self.strategy == "segfaults":
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.strategy == "oom":
            raise MemoryError("simulated: could not allocate 64 GiB")
        if self.strategy == "wrong":
            return torch.zeros(self.n, *x.shape[1:-1], self.out_features)
        return super().forward(x)


def synthetic_result(points):
    """A result of synthetic points, as the runner analyses measured ones."""
    from wide_tessera.core.environment import capture_environment
    from wide_tessera.measurement.settings import RunSettings
    from wide_tessera.results import analysis

    return analysis.result_of(
        points,
        op="synthetic",
        strategies=sorted({s for p in points for s in p.speedups if not s.startswith("loop_")}) or ["a"],
        environment=capture_environment("cpu"),
        timer="synthetic",
        settings=RunSettings(preset="test", device="cpu", timing=TimingConfig()),
        duration_s=0.0,
    )


def entry(op="gemm", params=None, verdicts="loop:1 fuse:4 fuse:16", strategy="bmm", device_name=None, **fields):
    """A synthetic entry measured on this CPU: verdicts as 'VERDICT:N ...'."""
    vs = [NVerdict(int(n), v, strategy if v == "fuse" else None) for v, n in (t.split(":") for t in verdicts.split())]
    values = dict(
        op=op,
        device="cpu",
        device_name=cpu_name() if device_name is None else device_name,
        dtype="float32",
        mode="inference",
        compile="none",
        cuda_graph=False,
        params={"batch": 16, "in_features": 32, "out_features": 32} if params is None else params,
        verdicts=vs,
        crossover_n=group_crossover([(v.n, v.verdict == "fuse") for v in vs]),
        measured_at="2026-11-01T00:00:00+00:00",
        versions={"torch": torch.__version__},
        threads=1,
        preset="ci",
    )
    values.update(fields)
    return DispatchEntry(**values)
