"""Triton kernels for wide strategies: a grouped GEMM (uniform and ragged groups), a flash attention
and N LoRA adapters on the segments of one batch.

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
from torch.torch_version import TorchVersion

__all__ = [
    "grouped_linear",
    "ragged_linear",
    "flash_attention",
    "segmented_lora",
    "triton_unavailable_reason",
    "require_triton",
    "wants_tma",
    "dot_precision",
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
        return _interpreter_problem()
    return f"needs a CUDA device; on {kind} Triton runs only under TRITON_INTERPRET=1, for correctness, not timing"


def require_triton(device: Any) -> None:
    """One clear error where the kernels cannot run on `device`, before triton fails deep inside.

    Without it a CPU tensor outside the interpreter, or triton 3.6's interpreter beside numpy
    2.4, failed with a page of interpreter traceback ending in a numpy TypeError.
    """
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"the Triton kernels cannot run on {torch.device(device)}: {reason}")


def dot_precision(dtype: torch.dtype) -> Optional[str]:
    """The kernels' tl.dot input_precision for `dtype`: None for half types (they have one),
    for float32 TF32 only where the user's torch allows it (torch.backends.cuda.matmul.allow_tf32),
    else full precision; the interpreter's numpy has no TF32."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not INTERPRETED else "ieee"


def wants_tma(tma: Optional[bool], *tensors: torch.Tensor) -> bool:
    """Whether a kernel with a TMA variant uses it on `tensors`: `tma` None where it can run
    (a CUDA device of capability 9.0 or later, tensors it can take), True always (one
    ValueError naming why where it cannot), False never."""
    if tma not in (None, True, False):
        raise ValueError(f"tma must be None (where it can run), True or False, got {tma!r}")
    if tma is False:  # nothing to ask of the device or the tensors on every call
        return False
    unfit = _tma_unfit(*tensors)
    if tma and unfit:
        raise ValueError(f"tma=True, but {unfit}")
    return tma is True or tensors[0].is_cuda and unfit is None


def _tma_unfit(*tensors: torch.Tensor) -> Optional[str]:
    """Why the TMA kernel cannot take these tensors, or None. The copy engine is Hopper's, and
    it reads any strided layout whose last dimension is dense, whose other strides are
    multiples of 16 bytes and whose start is 16-byte aligned: the q, k, v views of a fused
    projection qualify as they lie, so they are not copied to be contiguous."""
    device = tensors[0].device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability[0] < 9:
        return (
            f"TMA needs compute capability 9.0 (Hopper) or later; {torch.cuda.get_device_name(device)} has {capability}"
        )
    for t in tensors:
        shape, strides = tuple(t.shape), t.stride()
        if 0 in shape:
            return f"TMA needs non-empty tensors; one has shape {shape}"
        if strides[-1] != 1:
            return f"TMA needs a dense last dimension (stride 1); one of shape {shape} has strides {strides}"
        if any(s <= 0 or s * t.element_size() % 16 for s in strides[:-1]):
            return (
                f"TMA needs strides of a positive multiple of 16 bytes (but the last); "
                f"{shape} in {t.dtype} has strides {strides} ({t.element_size()} bytes each)"
            )
        if t.data_ptr() % 16:
            return f"TMA needs a 16-byte aligned start; a tensor of shape {shape} starts at {t.data_ptr():#x}"
    return None


def _interpreter_problem() -> Optional[str]:
    """Why this triton's interpreter cannot run the kernels beside this numpy, or None.

    Before 3.7 the interpreter turns a loop bound known only at run time (`range(0, K, BK)`)
    into an int from a 1-element array, which numpy 2.4 refuses: every kernel here failed so
    under triton 3.6 (torch 2.11's) with numpy 2.4.6 and 2.5.5, and passed with numpy 2.3.5
    (triton-lang/triton#9171, fixed in 3.7.0).
    """
    import numpy
    import triton

    if TorchVersion(triton.__version__) < (3, 7) and TorchVersion(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run with numpy {numpy.__version__} "
            "(triton-lang/triton#9171): install triton>=3.7 or numpy<2.4"
        )
    return None


def autotuned_kernels() -> Dict[str, Any]:
    """The autotuned Triton kernels behind each function, by function name (imports triton)."""
    from .attention import ATTENTION, ATTENTION_TMA
    from .grouped_gemm import GROUPED, GROUPED_TMA, RAGGED
    from .lora import LORA

    return {
        "grouped_linear": GROUPED,
        "grouped_linear_tma": GROUPED_TMA,
        "ragged_linear": RAGGED,
        "flash_attention": ATTENTION,
        "flash_attention_tma": ATTENTION_TMA,
        "segmented_lora": LORA,
    }


# Loaded on first use (PEP 562), so that importing this package never imports triton.
_LAZY = {
    "grouped_linear": ".grouped_gemm",
    "ragged_linear": ".grouped_gemm",
    "flash_attention": ".attention",
    "segmented_lora": ".lora",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
