"""wide_tessera: at what N does fusing N copies of an op beat N separate calls, and which strategy wins?"""

from .api import benchmark, benchmark_custom, measure
from .bench.job import BenchmarkJob, SweepParams
from .bench.registry import REGISTRY, register
from .bench.runner import run
from .bench.schema import BenchmarkResult, Failure, GroupResult, PointResult, load_results, save_results
from .bench.stages import StageTimeouts
from .bench.stats import TimingStats
from .bench.timing import TimingConfig
from .errors import WideTesseraError
from .ops import AttentionBlock, WideAttention, WideConv1d, WideConv2d, WideFunctional, WideLinear, WideOp

__version__ = "0.1.0"

__all__ = [
    "benchmark",
    "benchmark_custom",
    "measure",
    "run",
    "register",
    "REGISTRY",
    "load_results",
    "save_results",
    "BenchmarkJob",
    "SweepParams",
    "BenchmarkResult",
    "GroupResult",
    "PointResult",
    "Failure",
    "StageTimeouts",
    "TimingConfig",
    "TimingStats",
    "WideTesseraError",
    "WideOp",
    "WideLinear",
    "WideConv1d",
    "WideConv2d",
    "WideAttention",
    "AttentionBlock",
    "WideFunctional",
]
