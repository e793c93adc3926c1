"""One number per model for a step of a wide tensor, and the arithmetic torch's update rules do
with it, rounding as torch rounds."""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from ..core.layout import Layout

__all__ = ["Numbers", "mul_addcmul"]


class Numbers:
    """One number per model for a step of the wide tensors: a Python float where the N agree (then
    torch's own arithmetic, scalar for scalar), else the N spread over each model's part of a
    tensor, in at least float32 (a learning rate of 1e-3 in bfloat16 is 0.000999), converted once
    a step per device and dtype."""

    def __init__(self, values: torch.Tensor):
        self.values = values
        first = float(values[0])
        self.same: Optional[float] = first if bool((values == first).all()) else None
        self._on: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def over(self, layout: Layout, p: torch.Tensor) -> Union[float, torch.Tensor]:
        if self.same is not None:
            return self.same
        key = (p.device, torch.promote_types(p.dtype, torch.float32))
        if key not in self._on:
            self._on[key] = self.values.to(device=key[0], dtype=key[1])
        return layout.spread(self._on[key], p)

    def add_to(self, target: torch.Tensor, other: torch.Tensor, layout: Layout, sign: float = 1.0) -> torch.Tensor:
        """target += sign * number * other, as torch's `target.add_(other, alpha=...)` computes it
        (on a CPU a fused multiply-add, one rounding: a product then a sum ended a few elements an
        ulp away each step, which 200 steps of a sweep turned into 2% of a final loss), model by
        model where the numbers differ. Returns target."""
        if self.same is not None:
            return target.add_(other, alpha=sign * self.same)
        n = self.values.numel()
        for mine, theirs, value in zip(layout.parts(target, n), layout.parts(other, n), self.values.tolist()):
            mine.add_(theirs, alpha=sign * value)  # type: ignore[union-attr, arg-type]
        return target

    def model(self, i: int) -> "Numbers":
        """Model i's number alone."""
        return Numbers(self.values[i : i + 1])

    def addcdiv_to(self, target: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, layout: Layout) -> None:
        """target -= number * t1 / t2, model by model: torch's `addcdiv_(t1, t2, value=-number)`."""
        n = self.values.numel()
        parts = zip(layout.parts(target, n), layout.parts(t1, n), layout.parts(t2, n), self.values.tolist())
        for mine, a, b, value in parts:
            mine.addcdiv_(a, b, value=-value)  # type: ignore[union-attr, arg-type]


def mul_addcmul(
    t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, keep: Numbers, rest: Numbers, layout: Layout
) -> None:
    """t = t * keep + rest * a * b, as torch's `t.mul_(keep).addcmul_(a, b, value=rest)` computes it
    (a running average of squares: Adam's, Adadelta's); where `rest` differs per model, in
    addcmul's order, rest * a * b."""
    value = rest.over(layout, t)
    if isinstance(value, float):
        t.mul_(keep.over(layout, t)).addcmul_(a, b, value=value)
    else:
        t.mul_(keep.over(layout, t)).addcmul_(a * value, b)
