"""A value stacked on a leading N axis at run time: each model's own, or one tensor all models
share, passed once (expanded, stride 0 on N); one model's sizes of it, and its rank lifted so
that it broadcasts against the others model by model."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_shared", "with_ones", "model_size"]


def is_shared(x: Any) -> bool:
    """A tensor passed once for all N models: expanded, stride 0 on its N axis."""
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.stride(0) == 0 and x.size(0) > 1


def with_ones(stacked: torch.Tensor, rank: int) -> torch.Tensor:
    """A stacked tensor of a model's rank below `rank` with 1s after its N axis: broadcast
    against the others, each model's trailing dimensions align as they do for one model."""
    return stacked.reshape(stacked.shape[0], *[1] * (rank + 1 - stacked.dim()), *stacked.shape[1:])


def model_size(x: torch.Tensor, dim: int) -> int:
    """One model's size `dim` of a value stacked on a leading N axis: the stack's, one axis on."""
    return x.size(dim + 1 if dim >= 0 else dim)
