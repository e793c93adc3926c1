"""One trial's pieces: its seed, its random streams kept apart from every other draw, its model
built under the seed, its parameters."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from ...core.errors import WideTesseraError
from ...core.seeding import forked, seeded
from .training import Training


def trial_seed(trial: Any, params: Dict[str, Any]) -> int:
    """The seed a trial's model is built under: its 'seed' parameter, else its number."""
    seed = params.get("seed", trial.number)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**63:
        raise WideTesseraError(f"trial {trial.number}: seed={seed!r}: give an int from 0 to 2**63 - 1")
    return int(seed)


class Draws:
    """A trial's random numbers, each stream seeded from the trial's seed and kept apart from the
    others and from the caller's generator: its model's initial weights (drawn under the seed
    itself), its batches (`batch(params, step)` drawing random data or indices), and its
    training's (dropout's masks). A trial then gets the same weights and batches alone and in a
    group, whatever its group mates draw: with one stream for the group, each trial's random
    batches were other data than alone, and final values up to 71% apart."""

    def __init__(self, seed: int, device: str):
        self.where = torch.device(device)
        seeds = torch.randint(2**62, (2,), generator=torch.Generator().manual_seed(seed))
        data_seed, self.training_seed = seeds.tolist()
        with seeded(data_seed, device):
            self._data = self._state()

    def _state(self) -> List[torch.Tensor]:
        cuda = [torch.cuda.get_rng_state(self.where)] if self.where.type == "cuda" else []
        return [torch.get_rng_state(), *cuda]

    def batch(self, training: Training, params: Dict[str, Any], step: int, keep: bool = True) -> Tuple[Any, Any]:
        """training.batch(params, step) drawn from the trial's data stream (`keep`: the stream moves
        on; False: a look that leaves it where it was, for sizing and timing)."""
        with forked(str(self.where)):
            torch.set_rng_state(self._data[0])
            if self.where.type == "cuda":
                torch.cuda.set_rng_state(self._data[1], self.where)
            drawn = training.batch(params, step)
            if keep:
                self._data = self._state()
        return drawn


def build_model(
    build: Callable[[Dict[str, Any]], nn.Module], trial: Any, params: Dict[str, Any], device: str
) -> nn.Module:
    with seeded(trial_seed(trial, params), device):
        model = build(params)
    if not isinstance(model, nn.Module):
        raise WideTesseraError(f"build(params) returned {type(model).__name__}, not an nn.Module")
    return model


def suggested(suggest: Callable[[Any], Dict[str, Any]], trial: Any) -> Dict[str, Any]:
    params = suggest(trial)
    if not isinstance(params, dict):
        what = type(params).__name__
        raise WideTesseraError(f"suggest(trial) returned {what}; return a dict of the trial's parameters")
    return params


@dataclass
class Member:
    trial: Any
    params: Dict[str, Any]
    model: nn.Module
    draws: Draws
