"""wide_tessera: at what N does fusing N copies of an op beat N separate calls, and which strategy wins?

The names below load on first use (PEP 562), not when the package is imported: the
command line imports this package before it can catch a Ctrl-C, and torch takes
seconds to import. `wide_tessera.entry` is the command's light entry point.
"""

from importlib import import_module
from typing import Any, List

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "benchmark": ".api",
    "benchmark_custom": ".api",
    "measure": ".api",
    "fuse": ".dispatch.fuse",
    "Fused": ".dispatch.build",
    "DispatchWarning": ".dispatch.fuse",
    "DispatchTable": ".dispatch.table",
    "register": ".ops.registry",
    "register_strategy": ".ops.registry",
    "Needs": ".core.capabilities",
    "load_results": ".results.load",
    "save_results": ".results.schema",
    "to_dataframe": ".reports.tidy",
    "SweepParams": ".core.job",
    "BenchmarkResult": ".results.schema",
    "StageTimeouts": ".measurement.stages",
    "TimingConfig": ".measurement.timing",
    "TimingStats": ".core.stats",
    "RunSettings": ".measurement.settings",
    # The exception family (core.errors): catch WideTesseraError for anything the user can act on.
    "WideTesseraError": ".core.errors",
    "MissingDependency": ".core.errors",
    "ContractError": ".core.errors",
    "NotApplicable": ".core.errors",
    "DamagedFile": ".core.errors",
    "MeasurementFault": ".core.errors",
    "Interrupted": ".core.errors",
    "WideOp": ".ops",
}

# Subpackages a user reaches as attributes (`wt.optim.AdamW`), loaded on first use like the names.
_SUBPACKAGES = ("optim",)

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return import_module(f".{name}", __name__)  # the import sets it on the package
    if name not in _EXPORTS:
        raise AttributeError(f"module 'wide_tessera' has no attribute {name!r}")
    import_module(".api", __name__)  # registers the built-in ops, whatever is asked for first
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted([*globals(), *_EXPORTS, *_SUBPACKAGES])
