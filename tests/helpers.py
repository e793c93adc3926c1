"""What several test modules share: fake ops and models, and the fast timing. Test modules
import from here, never from each other."""

import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

from wide_tessera import SweepParams, TimingConfig, WideLinear

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
