"""Whether two measurements were made alike: one list of what says how a result was measured.

`--resume` refuses to add points to a file measured otherwise (they would be mixed under one
label), `compare` names what differs between two runs, and a run's table is held against the
previous run only where nothing does. Asked in two places with two lists, the answers drifted:
compare missed --energy and --precise, resume missed the Triton and Python versions. One list,
built from RunSettings' own `resume` flags and the machine, answers all three.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from ..core.environment import Environment
from ..measurement.settings import RunSettings
from .schema import BenchmarkResult

__all__ = ["measured_with", "differences"]


def measured_with(settings: RunSettings, env: Environment) -> List[Tuple[str, Any]]:
    """Everything that changes what a measurement means, by name: the settings that say so of
    themselves (RunSettings' `resume` flag), then the machine and its software."""
    return [
        *settings.resumable_as(),
        ("device", env.device),
        ("threads", env.threads),
        ("device name", env.device_name),
        ("torch", env.torch_version),
        ("triton", env.triton_version),
        ("python", env.python_version),
    ]


def differences(base: BenchmarkResult, new: BenchmarkResult) -> List[Tuple[str, Any, Any]]:
    """(what, base's, new's) for each way the two results were measured differently: the list
    above, the timer, and where both record their runs, the host, environment variables and code."""
    pairs = [
        (name, old, now)
        for (name, old), (_, now) in zip(
            measured_with(base.settings, base.environment), measured_with(new.settings, new.environment)
        )
    ]
    pairs.append(("timer", base.timer, new.timer))
    if base.runs and new.runs:
        b, n = base.runs[-1], new.runs[-1]
        pairs += [
            ("host", b.host, n.host),
            ("environment variables", b.env, n.env),
            ("git commit", b.git.commit[:12] if b.git else None, n.git.commit[:12] if n.git else None),
        ]
    return [(what, x, y) for what, x, y in pairs if x != y]
