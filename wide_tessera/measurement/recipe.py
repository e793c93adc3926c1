"""The train mode's training step, as a hyperparameter sweep runs it: after the backward, each of
the N models is clipped to its own gradient norm, stepped by AdamW with its own learning rate,
betas and weight decay, and its learning rate follows its own cosine schedule.

The baseline trains N separate models, each with its own torch.optim.AdamW, clip and schedule
(what a sweep runs one trial at a time); the optimizer controls step the N models with one
torch optimizer of N parameter groups in its foreach or fused implementation; a wide module is
trained by wide_tessera.optim over its wide tensors. The settings are drawn per point from the
run's seed: a strategy that mixes up the models' settings, clips them jointly or loses an
update ends its check away from the separate trainings (core.correctness.check_trained).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..core.layout import model_state_dicts
from ..train import separate_step, wide_step

__all__ = ["Recipe", "TRAIN_STEPS", "MAX_NORM"]

# Steps the check trains each side before comparing the N models: enough for a wrong learning
# rate or a joint clip to move every element, few enough to check every strategy at every point.
TRAIN_STEPS = 10
MAX_NORM = 1.0


@dataclass(frozen=True)
class Recipe:
    """Each model's AdamW settings (lr, betas, weight decay), one per model."""

    lr: Tuple[float, ...]
    betas: Tuple[Tuple[float, float], ...]
    weight_decay: Tuple[float, ...]

    @staticmethod
    def drawn(n: int, seed: int) -> "Recipe":
        """N models' settings as a sweep draws them: lr log-uniform in [1e-4, 1e-2], beta1 in
        [0.8, 0.95], beta2 in [0.99, 0.9999], weight decay in [0, 0.1]. Python's generator:
        torch's, which draws the models and their dropout, is left as it is."""
        g = random.Random(seed)
        return Recipe(
            tuple(10 ** g.uniform(-4, -2) for _ in range(n)),
            tuple((g.uniform(0.8, 0.95), g.uniform(0.99, 0.9999)) for _ in range(n)),
            tuple(g.uniform(0.0, 0.1) for _ in range(n)),
        )

    @property
    def n(self) -> int:
        return len(self.lr)

    def _settings(self, i: int) -> Dict[str, Any]:
        return dict(lr=self.lr[i], betas=self.betas[i], weight_decay=self.weight_decay[i])

    def stepper(self, modules: List[nn.Module], wide: bool, implementation: Optional[str]) -> Callable[[], None]:
        """What follows a backward on a side (train.Step: clip each model, step, zero the gradients,
        advance the schedules). `modules`: the N models (wide False), or one wide module of them;
        implementation: None, N torch optimizers in torch's default implementation, or 'foreach' /
        'fused', one torch optimizer of N parameter groups in it."""
        settings = [self._settings(i) for i in range(self.n)]
        def cosine(optimizer: torch.optim.Optimizer) -> Any:  # each param group (each model) from its own lr
            return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=TRAIN_STEPS)

        if wide:
            (module,) = modules
            return wide_step(module, "adamw", settings, MAX_NORM, cosine)
        return separate_step(modules, "adamw", settings, MAX_NORM, cosine, implementation)

    def states(self, modules: List[nn.Module], wide: bool) -> List[Dict[str, torch.Tensor]]:
        """The N models' parameters and persistent buffers (a tied weight under its first name)."""
        if wide:
            return model_state_dicts(modules[0], self.n)
        return [_own_state(m) for m in modules]


def _own_state(module: nn.Module) -> Dict[str, torch.Tensor]:
    """`module`'s state_dict, a tensor tied under two names given under the first only, as a wide
    module's slots name it; each a copy."""
    seen, state = set(), {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            state[name] = t.detach().clone()
    return state
