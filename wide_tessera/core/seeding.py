"""Random draws kept apart: a block's draws from a seed of its own, or on a fork of the generators,
the caller's generators left as they were after it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

__all__ = ["forked", "seeded"]


def forked(device: str) -> Any:
    """The block's random draws on a fork of the generators `device` draws from (the CPU's, and a
    CUDA device's own): the caller's are left as they were."""
    where = torch.device(device)
    return torch.random.fork_rng(devices=[where.index or 0] if where.type == "cuda" else [])


@contextmanager
def seeded(seed: int, device: str) -> Iterator[None]:
    """The block's random draws (a model's initial weights, dropout's masks, random inputs) from
    `seed`, on a fork: what the block draws does not depend on what ran before it, and what runs
    after it does not depend on what the block drew."""
    with forked(device):
        torch.manual_seed(seed)
        yield
