"""Where a result was measured: device, library versions, threads."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Optional

import torch
from dataclasses_json import dataclass_json

__all__ = ["Environment", "capture_environment", "cpu_name", "triton_version"]


@dataclass_json
@dataclass(frozen=True)
class Environment:
    device: str
    device_name: str
    torch_version: str
    triton_version: Optional[str]
    python_version: str
    threads: int
    platform: str


def capture_environment(device: str) -> Environment:
    return Environment(
        device=device,
        device_name=_device_name(device),
        torch_version=torch.__version__,
        triton_version=triton_version(),
        python_version=platform.python_version(),
        threads=torch.get_num_threads(),
        platform=platform.platform(),
    )


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)
