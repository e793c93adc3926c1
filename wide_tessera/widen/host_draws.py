"""Python's and NumPy's global generators, which neither a captured graph nor vmap can draw from
for each model: whether a call moved them, and putting them back."""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ..core.errors import NotApplicable

__all__ = ["HostGenerators", "python_draws_refused"]


class HostGenerators:
    """Python's and NumPy's global generators as they are when this is made: whether they have
    `moved` since, and `restore` them. torch's own are forked where they are kept (fork_rng)."""

    def __init__(self) -> None:
        self.python, self.numpy = random.getstate(), np.random.get_state(legacy=False)

    def moved(self) -> bool:
        now, then = np.random.get_state(legacy=False)["state"], self.numpy["state"]
        numpy_moved = now["pos"] != then["pos"] or not np.array_equal(now["key"], then["key"])
        return numpy_moved or random.getstate() != self.python

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)


@contextmanager
def python_draws_refused(what: str, looking: bool = True) -> Iterator[None]:
    """Refuse, in one line, models whose forward draws from Python's or NumPy's global generator:
    a captured graph keeps the draw its capture made for every later call, and vmap draws once
    for all N models, where N separate calls draw N times (a stochastic depth written with
    random.random() ran the capture's choice at every step, silently)."""
    before = HostGenerators() if looking else None
    yield
    if before is not None and before.moved():
        raise NotApplicable(
            f"{what}: the models draw from Python's or NumPy's random generator in forward, which a fused model "
            "cannot draw for each model; draw with torch (torch.rand, dropout) and randomness='different'"
        )
