"""What produced a result: the command, the code's git state, the machine, the software, the settings.

A number without this is hard to trust and impossible to reproduce: a comparison of two
runs names what differs between their manifests (`reports.compare`), and a report prints it.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np
import torch
from dataclasses_json import dataclass_json

from ..core.environment import cpu_name, triton_version
from ..measurement.health import Nvml

__all__ = ["GitState", "Manifest", "capture_manifest", "now", "TIMING_ENV"]

# Environment variables that change what a timing means: which devices and how many threads,
# the BLAS and OpenMP libraries' behaviour, torch's and Triton's switches, the allocator
# (timing.py measured glibc's malloc moving a CPU timing by itself).
TIMING_ENV = re.compile(
    r"^(CUDA_|NVIDIA_|CUBLAS|CUDNN|NCCL_|OMP_|KMP_|GOMP_|MKL_|OPENBLAS_|BLIS_|TORCH|PYTORCH_|TRITON_|"
    r"WIDE_TESSERA_|MALLOC_|GLIBC_TUNABLES$|LD_PRELOAD$)"
)

# The environment as the process found it: torch sets some of these variables itself while it
# runs (TORCHINDUCTOR_CACHE_DIR, on its first compilation), which would make the second op of
# one command look differently configured from the first.
_STARTUP_ENV = {k: v for k, v in sorted(os.environ.items()) if TIMING_ENV.match(k)}


@dataclass_json
@dataclass(frozen=True)
class GitState:
    """The git state of the directory the run was started in (the user's code, not ours)."""

    commit: str
    branch: str
    dirty: bool


@dataclass_json
@dataclass(frozen=True)
class Manifest:
    """One run of the measuring loop: a `--resume` adds another to the same result.

    cores: the machine's logical CPUs; usable_cores: those this process may run on
    (taskset, cgroups). governor: the CPU frequency governor where Linux shows it.
    gpu: name, driver, CUDA version and clocks (MHz, now and at most) where the run is on one.
    env: the environment variables that change timings (TIMING_ENV), as the process started.
    seed: the seed of models and inputs (the timing settings are the result's own fields).
    """

    run_id: str
    command: List[str]
    started: str
    finished: Optional[str]
    cwd: str
    git: Optional[GitState]
    host: str
    cpu: str
    cores: int
    usable_cores: int
    governor: Optional[str]
    gpu: Dict[str, Union[str, int, None]]
    env: Dict[str, str]
    versions: Dict[str, Optional[str]]
    seed: int


def now() -> str:
    """The time, as ISO 8601 in UTC to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def capture_manifest(device: str, seed: int, cwd: Optional[Path] = None) -> Manifest:
    """The manifest of a run starting now, in `cwd` (default: the current directory)."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    return Manifest(
        run_id=uuid.uuid4().hex[:12],
        command=list(sys.orig_argv),
        started=now(),
        finished=None,
        cwd=str(cwd),
        git=git_state(cwd),
        host=socket.gethostname(),
        cpu=cpu_name(),
        cores=os.cpu_count() or 1,
        usable_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        governor=_governor(),
        gpu=_gpu(device),
        env=dict(_STARTUP_ENV),
        versions=_versions(),
        seed=seed,
    )


def git_state(directory: Path) -> Optional[GitState]:
    """Commit, branch and dirty flag (tracked files changed) of the repository holding `directory`;
    None outside a repository or without git."""

    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(
                ["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return GitState(commit, git("rev-parse", "--abbrev-ref", "HEAD") or "", bool(status))


def _governor() -> Optional[str]:
    try:
        return Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").read_text().strip()
    except OSError:  # not Linux, or a VM that hides it
        return None


def _gpu(device: str) -> Dict[str, Union[str, int, None]]:
    if torch.device(device).type != "cuda":
        return {}
    facts: Dict[str, Union[str, int, None]] = {"name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    nvml = Nvml.open(device)
    if nvml is not None:
        try:
            facts.update(nvml.facts())
        except Exception:  # noqa: BLE001  an NVML call this driver does not support: the rest stays
            pass
    return facts


def _versions() -> Dict[str, Optional[str]]:
    try:
        ours: Optional[str] = metadata.version("wide_tessera")
    except metadata.PackageNotFoundError:  # run from a source tree
        ours = None
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "triton": triton_version(),
        "numpy": np.__version__,
        "wide_tessera": ours,
    }
