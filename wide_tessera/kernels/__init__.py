"""Triton kernels for wide strategies: a grouped GEMM (uniform and ragged groups) and a flash attention.

Each is one launch for all N problems. They run on CUDA devices; on the CPU only under
Triton's interpreter (TRITON_INTERPRET=1 set before this package is first imported),
which is exact enough to test them and far too slow to time them. Importing this package
never needs triton: the kernels load on first use.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, Optional

import torch

__all__ = [
    "grouped_linear",
    "ragged_linear",
    "flash_attention",
    "triton_unavailable_reason",
    "autotuned_kernels",
    "INTERPRETED",
]

# Triton decides when a kernel is decorated whether it is interpreted: what this flag says
# when the kernels load is what they are for the whole process.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable_reason(device: Any) -> Optional[str]:
    """Why the kernels cannot run on tensors on `device`, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "needs triton (pip install triton)"
    kind = torch.device(device).type
    if kind == "cuda":
        return None
    if kind == "cpu" and INTERPRETED:
        return None
    return f"needs a CUDA device; on {kind} Triton runs only under TRITON_INTERPRET=1, for correctness, not timing"


def autotuned_kernels() -> Dict[str, Any]:
    """The autotuned Triton kernels behind each function, by function name (imports triton)."""
    from .attention import ATTENTION
    from .grouped_gemm import GROUPED, RAGGED

    return {"grouped_linear": GROUPED, "ragged_linear": RAGGED, "flash_attention": ATTENTION}


# Loaded on first use (PEP 562), so that importing this package never imports triton.
_LAZY = {"grouped_linear": ".grouped_gemm", "ragged_linear": ".grouped_gemm", "flash_attention": ".attention"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
