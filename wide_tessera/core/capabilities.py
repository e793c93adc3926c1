"""What a strategy needs from the run (a CUDA device, a compute capability, a dtype, triton), checked before it runs.

A strategy the run cannot give what it needs is skipped with the reason recorded,
never run to fail: a Triton kernel on a CPU, or `torch._grouped_mm` where this torch
or this GPU has no kernel for it, is a fact about the machine, not a broken strategy.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

__all__ = ["Needs", "Probe", "unmet_need"]

# probe(device, dtype, params) -> None when the strategy can run there at the point's
# parameters, else the reason it cannot.
Probe = Callable[[torch.device, torch.dtype, Dict[str, Any]], Optional[str]]


@dataclass(frozen=True)
class Needs:
    """What a strategy needs. `probe` asks the software itself, for needs no field can state
    (an operator whose kernels exist for some devices, dtypes or shapes only)."""

    cuda: bool = False
    min_capability: Optional[Tuple[int, int]] = None
    dtypes: Optional[Tuple[str, ...]] = None
    triton: bool = False
    probe: Optional[Probe] = None
    # The probe builds and calls the op itself (hf_experts' asks transformers' experts at the
    # point's sizes: 14.8 s of `wide_tessera list`'s 33.7 s under cProfile, 2-core CPU, loaded):
    # a run asks it before measuring a point, `wide_tessera list` leaves it to the run.
    probe_runs_op: bool = False
    # Under torch.compile, where tracing accepts fewer dtypes than the eager kernels do.
    compiled_dtypes: Optional[Tuple[str, ...]] = None


def unmet_need(
    needs: Optional[Needs],
    device: str,
    dtype: torch.dtype,
    params: Optional[Dict[str, Any]] = None,
    compiling: bool = False,
) -> Optional[str]:
    """Why a strategy with `needs` cannot run on `device` in `dtype` at `params` (under torch.compile
    when `compiling`), or None when it can."""
    if needs is None:
        return None
    dev = torch.device(device)
    if needs.cuda and dev.type != "cuda":
        return f"needs a CUDA device; this run is on {device}"
    if needs.min_capability is not None and dev.type == "cuda":
        have = torch.cuda.get_device_capability(dev)
        if have < needs.min_capability:
            want = ".".join(map(str, needs.min_capability))
            return (
                f"needs compute capability {want} or newer; {torch.cuda.get_device_name(dev)} has {have[0]}.{have[1]}"
            )
    name = str(dtype).replace("torch.", "")
    if needs.dtypes is not None and name not in needs.dtypes:
        return f"needs dtype {' or '.join(needs.dtypes)}; this point is {name}"
    if compiling and needs.compiled_dtypes is not None and name not in needs.compiled_dtypes:
        return f"needs dtype {' or '.join(needs.compiled_dtypes)} under torch.compile; this point is {name}"
    if needs.triton and importlib.util.find_spec("triton") is None:
        return "needs triton (pip install triton)"
    return needs.probe(dev, dtype, dict(params or {})) if needs.probe is not None else None
