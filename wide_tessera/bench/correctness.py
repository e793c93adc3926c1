"""Is a wide output the same as N separate calls? Relative error against a dtype-aware tolerance."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from dataclasses_json import dataclass_json

__all__ = ["Check", "tolerance", "check_outputs"]

# Norm-wise relative error allowed per dtype: a few units of rounding of the
# dtype, since a wide strategy sums in a different order than the baseline.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# TF32 keeps a 10-bit mantissa, like float16.
_TF32_TOLERANCE = 5e-3


@dataclass_json
@dataclass(frozen=True)
class Check:
    """The verdict on one strategy at one point; `error` says why it failed."""

    correct: bool
    max_rel_error: Optional[float]
    tolerance: float
    error: Optional[str] = None


def tolerance(dtype: torch.dtype, device: str) -> float:
    """The relative-error bound for `dtype`; float32 on CUDA is judged as TF32 when torch allows TF32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    if dtype == torch.float32 and torch.device(device).type == "cuda" and tf32:
        return _TF32_TOLERANCE
    return _TOLERANCE[dtype]


def check_outputs(outputs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], tol: float) -> Check:
    """Compare each of the N outputs with its reference by ||out - ref|| / ||ref||."""
    if len(outputs) != len(reference):
        return Check(False, None, tol, f"{len(outputs)} outputs for {len(reference)} models")
    worst = 0.0
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        if not isinstance(out, torch.Tensor):
            return Check(False, None, tol, f"output {i} is a {type(out).__name__}, not a Tensor")
        if out.shape != ref.shape:
            return Check(False, None, tol, f"output {i} has shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
        if not torch.isfinite(out).all():
            return Check(False, None, tol, f"output {i} contains NaN or Inf")
        diff = torch.linalg.vector_norm((out - ref).double()).item()
        scale = torch.linalg.vector_norm(ref.double()).item()
        rel = diff / scale if scale > 0 else diff
        worst = max(worst, rel)
    if not math.isfinite(worst) or worst > tol:
        return Check(False, worst, tol, f"relative error {worst:.3g} exceeds tolerance {tol:.3g}")
    return Check(True, worst, tol)
