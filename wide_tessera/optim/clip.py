"""Gradient clipping per model: N models' gradients clipped as N separate calls of torch's
`clip_grad_norm_` would clip them.

`torch.nn.utils.clip_grad_norm_(fused.parameters(), 1.0)` on a wide module clips all N models by
one joint norm: the model with the largest gradients sets the scale for all. Measured on four
stacked MLPs: per-model norms after clipping 1.9e-6, 1.1e-4, 5.4e-3 and 1.0, where four
separate clips give 0.84, 1, 1 and 1.
"""

from __future__ import annotations

from typing import Any, List

import torch
from torch import nn

from ..core.errors import WideTesseraError
from ..core.layout import Layout, slots_of
from .per_model import models_in, number, per_model

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    module: nn.Module, max_norm: Any, norm_type: Any = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip each model's gradients to its own total norm `max_norm` (one number, or one per model),
    as torch's clip_grad_norm_ over that model's parameters does, and return the N models' total
    norms before clipping, a tensor of N. `module` is what fuse() returned (or a wide module)."""
    n = models_in(module)
    limits = torch.tensor(per_model("max_norm", max_norm, n, number(0.0, infinite=True)), dtype=torch.float64)
    norm = number(0.0, infinite=True)("norm_type", _read(norm_type))
    grads: List[torch.Tensor] = []
    layouts: List[Layout] = []
    params = dict(module.named_parameters())
    seen = set()
    for key, slot in slots_of(module).items():
        p = params.get(key)
        if p is None or p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        grads.append(p.grad)
        layouts.append(slot.layout)
    if not grads:
        return torch.zeros(n)
    per_tensor = [layout.norms(g, n, norm).to(grads[0].device) for g, layout in zip(grads, layouts)]
    total = torch.linalg.vector_norm(torch.stack(per_tensor), norm, dim=0)
    if error_if_nonfinite and not torch.isfinite(total).all():
        bad = [i for i, t in enumerate(total.tolist()) if not torch.isfinite(torch.tensor(t))]
        raise WideTesseraError(
            f"the total norm of the gradients of model(s) {bad} is not finite: they cannot be clipped "
            "(error_if_nonfinite=False clips the others and leaves them to the optimizer)"
        )
    # torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1
    coef = torch.clamp(limits.to(total) / (total + 1e-6), max=1.0)
    for g, layout in zip(grads, layouts):
        g.mul_(layout.spread(coef.to(g.dtype), g))
    clipped: torch.Tensor = total
    return clipped


def _read(norm_type: Any) -> Any:
    """`norm_type` as torch reads it, through float(): the string 'inf' is infinity."""
    try:
        return float(norm_type) if isinstance(norm_type, str) else norm_type
    except ValueError:
        return norm_type
