"""Train N models as one, each with its own settings: optimizers, gradient clipping and
learning-rate schedules over what `wide_tessera.fuse()` returned, whichever strategy runs it.

    fused = wt.fuse(models, strategy="vmap")
    opt = wt.optim.AdamW(fused, lr=[1e-3, 3e-4, 1e-4, 3e-5], weight_decay=0.01)
    sched = wt.optim.CosineAnnealingLR(opt, T_max=1000)
    for x, y in data:
        loss = sum(F.mse_loss(out, y) for out in fused.unpack(fused(fused.pack([x] * 4))))
        loss.backward()
        wt.optim.clip_grad_norm_(fused, 1.0)   # each model by its own norm
        opt.step(); opt.zero_grad(); sched.step()
    models = fused.unfuse()                     # N modules of the original class, trained
"""

from .base import IMPLEMENTATIONS
from .clip import clip_grad_norm_
from .optimizers import SGD, Adadelta, Adam, AdamW
from .schedules import CosineAnnealingLR, LinearLR, StepLR

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "Adadelta",
    "IMPLEMENTATIONS",
    "clip_grad_norm_",
    "StepLR",
    "CosineAnnealingLR",
    "LinearLR",
]
