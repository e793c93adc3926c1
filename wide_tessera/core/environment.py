"""Where a result was measured: device, library versions, threads."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from dataclasses_json import dataclass_json

__all__ = ["Environment", "capture_environment", "cpu_name", "cpu_l2_bytes", "triton_version"]


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
        torch_version=str(torch.__version__),  # a TorchVersion saves as a str and loads as one
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


def cpu_l2_bytes() -> Optional[int]:
    """The L2 cache of one core, as Linux's sysfs says ("2048K"); None where it says nothing."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip()
                return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
        except (OSError, ValueError):
            return None
    return None


def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)
