"""N models' optimizers as one, each model with its own settings: SGD, Adam, AdamW and Adadelta
over what fuse() returned, whichever strategy runs it (the machinery they share: optim.base).

Each steps a wide tensor by torch's update rule, term by term, with per-model numbers where torch
has one number. Adam and AdamW asked for 'foreach' or 'fused' instead call torch's own kernels over
the models' parts, one call per set of models with equal settings: the fused kernel reads a tensor
once where the term-by-term rule reads it about eight times (N=32 MLPs of hidden 256 on one CPU
core: an optimizer step of 31 ms term by term, 12 to 14 ms fused; at hidden 64 the N calls cost
more than they save, 3.2 ms against 1.4).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn
from torch.optim.adam import adam as torch_adam
from torch.optim.adamw import adamw as torch_adamw

from ..core.errors import WideTesseraError
from ..core.layout import Layout
from .base import PerModelOptimizer
from .numbers import Numbers, mul_addcmul
from .per_model import flag, number

__all__ = ["SGD", "Adam", "AdamW", "Adadelta"]

Check = Callable[[str, Any], Any]
# A wide tensor's part of one model, its gradient's and its moments' (in that order), and the model's step count
_Parts = List[Tuple[Sequence[Optional[torch.Tensor]], float]]


# tensor with a per-model factor: the factor's temporary costs a pass over memory, N calls cost
# their overhead. One core: a per-model addcdiv_ took 0.27 ms against 0.40 ms at [8, 256, 256],
# 0.35 against 0.40 at [32, 128, 128], 0.15 against 0.07 at [32, 64, 64].
# A fact of this machine, and of N, that no machine fact read at run time gives yet:
# scripts/large_part.py (one thread, 2-core EPYC with 1 MiB of L2 a core, at a load of 6) put the
# crossing between 65536 and 262144 elements a part at N=2, near 32768 at N=8, between 16384 and
# 32768 at N=32; the wide tensor's size against L2 does not give it either: at the same 2 MiB
# wide tensor the wide form took 2.05x the per-model form's time at N=8, and 0.70x at N=32.
# On a GPU, where N calls are N launches of several microseconds, the wide form should win far
# beyond it; not measured there.
_LARGE_PART = 16384


class SGD(PerModelOptimizer):
    """torch.optim.SGD for each of the N models: lr, momentum, dampening, weight_decay and nesterov,
    each one value or one per model."""

    TORCH: ClassVar[Type[torch.optim.Optimizer]] = torch.optim.SGD
    SETTINGS = {
        "lr": number(0.0),
        "momentum": number(0.0),
        "dampening": number(0.0),
        "weight_decay": number(0.0),
        "nesterov": flag,
    }
    MOMENTS = ("momentum_buffer",)

    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        momentum: Any = 0.0,
        dampening: Any = 0.0,
        weight_decay: Any = 0.0,
        nesterov: Any = False,
        implementation: Optional[str] = None,
        **others: Any,
    ):
        super().__init__(
            module, implementation, lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, **others,
        )  # fmt: skip

    def _check_group(self, i: int, group: Dict[str, Any]) -> None:
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise WideTesseraError(f"model {i}: nesterov momentum needs momentum > 0 and dampening 0")

    def _numbers(self, s: Dict[str, torch.Tensor], steps: torch.Tensor) -> Dict[str, Any]:
        # torch: the first step's buffer is the gradient itself; later, momentum * buf + (1 - dampening) * grad;
        # a model without momentum has none, its step the gradient (here: a buffer equal to it)
        fresh = (steps == 1) | (s["momentum"] == 0)
        return {
            "decay": Numbers(s["weight_decay"]) if s["weight_decay"].any() else None,
            "keep": Numbers(torch.where(fresh, 0.0, s["momentum"])) if s["momentum"].any() else None,
            "scale": Numbers(torch.where(fresh, 1.0, 1.0 - s["dampening"])),
            "nesterov": Numbers(s["nesterov"]) if s["nesterov"].any() else None,
            "momentum": Numbers(s["momentum"]),
            "lr": Numbers(s["lr"]),
        }

    def _update(
        self, p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], layout: Layout, c: Dict[str, Any]
    ) -> None:
        if c["decay"] is not None:  # torch: grad.add(param, alpha=weight_decay)
            g = c["decay"].add_to(g.clone(), p, layout)
        if c["keep"] is not None:  # torch: buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            buf = state["momentum_buffer"]
            c["scale"].add_to(buf.mul_(c["keep"].over(layout, p)), g, layout)
            if c["nesterov"] is None:
                g = buf
            else:  # torch: grad.add(buf, alpha=momentum)
                nesterov = c["nesterov"].over(layout, p)
                ahead = c["momentum"].add_to(g.clone(), buf, layout)
                if isinstance(nesterov, float):
                    g = ahead if nesterov else buf
                else:
                    g = torch.where(nesterov > 0, ahead, buf)
        c["lr"].add_to(p, g, layout, sign=-1.0)  # torch: param.add_(grad, alpha=-lr)

    def _init_state(self, state: Dict[str, Any], p: torch.Tensor) -> None:
        state["step"] = torch.zeros(self.n, dtype=torch.float64)
        momentum = any(g["momentum"] > 0 for g in self.param_groups)
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format) if momentum else None

    def _torch_state(self, i: int, state: Dict[str, Any], parts: Dict[str, Any]) -> Dict[str, Any]:
        """torch's SGD keeps a momentum buffer only where there is momentum, and no step count."""
        buf = parts.get("momentum_buffer")
        return {"momentum_buffer": buf.clone() if buf is not None and self.param_groups[i]["momentum"] > 0 else None}

    def _load_part(self, i: int, state: Dict[str, Any], one: Dict[str, Any], layout: Layout) -> None:
        state["step"][i] = 1.0  # torch's SGD counts no steps: it has stepped, so its buffer is not fresh
        if one.get("momentum_buffer") is not None and state["momentum_buffer"] is not None:
            layout.parts(state["momentum_buffer"], self.n)[i].copy_(one["momentum_buffer"])  # type: ignore[union-attr]


class Adam(PerModelOptimizer):
    """torch.optim.Adam for each of the N models: lr, betas, eps, weight_decay (added to the
    gradient) and amsgrad, each one value or one per model (betas: one pair, each coefficient one
    value or N, or N pairs)."""

    TORCH: ClassVar[Type[torch.optim.Optimizer]] = torch.optim.Adam
    SETTINGS = {
        "lr": number(0.0),
        "betas": number(0.0, 1.0, open_high=True),  # each coefficient's, the pair per_model_pairs's
        "eps": number(0.0),
        "weight_decay": number(0.0),
        "amsgrad": flag,
    }
    PAIRS = ("betas",)
    MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    DECOUPLED = False
    TORCH_STEP: ClassVar[Callable[..., None]] = staticmethod(torch_adam)

    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        betas: Any = (0.9, 0.999),
        eps: Any = 1e-8,
        weight_decay: Any = 0.0,
        amsgrad: Any = False,
        implementation: Optional[str] = None,
        **others: Any,
    ):
        super().__init__(
            module, implementation, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **others
        )

    def _init_state(self, state: Dict[str, Any], p: torch.Tensor) -> None:
        """torch's Adam keeps the largest second moment only where amsgrad is on."""
        super()._init_state(state, p)
        if not any(g["amsgrad"] for g in self.param_groups):
            state["max_exp_avg_sq"] = None

    def _torch_state(self, i: int, state: Dict[str, Any], parts: Dict[str, Any]) -> Dict[str, Any]:
        own = super()._torch_state(i, state, parts)
        if not self.param_groups[i]["amsgrad"]:
            own.pop("max_exp_avg_sq", None)
        return own

    def _numbers(self, s: Dict[str, torch.Tensor], steps: torch.Tensor) -> Dict[str, Any]:
        steps = steps.clamp(min=1.0)  # a frozen model's 0 steps would divide by zero; its part is restored
        bias1, bias2 = 1 - s["beta1"] ** steps, 1 - s["beta2"] ** steps
        decay = (1 - s["lr"] * s["weight_decay"]) if self.DECOUPLED else s["weight_decay"]
        return {
            "decay": Numbers(decay) if s["weight_decay"].any() else None,
            "beta1": Numbers(1 - s["beta1"]),
            "beta2": Numbers(s["beta2"]),
            "beta2_rest": Numbers(1 - s["beta2"]),
            "bias2_sqrt": Numbers(bias2.sqrt()),
            "eps": Numbers(s["eps"]),
            "step_size": Numbers(s["lr"] / bias1),
            "amsgrad": Numbers(s["amsgrad"]) if s["amsgrad"].any() else None,
        }

    def _update(
        self, p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], layout: Layout, c: Dict[str, Any]
    ) -> None:
        """torch's single-tensor Adam, line by line, with each model's numbers over its part."""
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # torch skips a weight_decay of 0 (in float16, 0 * an inf parameter would be NaN)
        if c["decay"] is not None and c["decay"].same != (1.0 if self.DECOUPLED else 0.0):
            decay = c["decay"].over(layout, p)
            if self.DECOUPLED:  # torch: param.mul_(1 - lr * weight_decay)
                p.mul_(decay)
            else:  # torch: grad.add(param, alpha=weight_decay)
                g = c["decay"].add_to(g.clone(), p, layout)
        m.lerp_(g, c["beta1"].over(layout, p))  # torch: exp_avg.lerp_(grad, 1 - beta1)
        mul_addcmul(v, g, g, c["beta2"], c["beta2_rest"], layout)  # torch: exp_avg_sq's, by beta2
        amsgrad = c["amsgrad"].over(layout, p) if c["amsgrad"] is not None else 0.0
        if not isinstance(amsgrad, float) or amsgrad:  # torch: torch.maximum(max_exp_avg_sq, exp_avg_sq, out=...)
            top = state["max_exp_avg_sq"]
            torch.maximum(top, v, out=top)
            v = top if isinstance(amsgrad, float) else torch.where(amsgrad > 0, top, v)  # the denominator's
        denom = (v.sqrt() / c["bias2_sqrt"].over(layout, p)).add_(c["eps"].over(layout, p))
        step_size = c["step_size"].over(layout, p)
        if isinstance(step_size, float):  # torch: param.addcdiv_(exp_avg, denom, value=-step_size)
            p.addcdiv_(m, denom, value=-step_size)
        elif p.numel() >= _LARGE_PART * self.n:  # torch's addcdiv_ on each model's part: one pass, no temporary
            c["step_size"].addcdiv_to(p, m, denom, layout)
        else:  # in addcdiv's order, value * exp_avg / denom: the same rounding, bit for bit
            p.addcdiv_(torch.mul(m, step_size), denom, value=-1.0)

    def _step_wide(self) -> None:
        if self.implementation is None:
            super()._step_wide()
            return
        alike: Dict[str, List[int]] = {}  # the models of equal settings, stepped by one call
        for i, group in enumerate(self.param_groups):
            if i not in self.frozen:
                alike.setdefault(repr([group[k] for k in self.SETTINGS]), []).append(i)
        # each model's parts of every wide tensor (the tensor, its gradient, its moments) and its step count
        parts: List[_Parts] = [[] for _ in range(self.n)]
        for w, skipped in self._stepped():
            state = self.state[w.tensor]
            counts = state["step"].tolist()
            state["step"] += self._active(skipped)  # torch's kernel counts its own copy of the count, below
            tensors = [w.tensor, w.tensor.grad, *(state[k] for k in self.MOMENTS if state[k] is not None)]
            for i, four in enumerate(zip(*(w.layout.parts(t, self.n) for t in tensors))):
                if i not in skipped:
                    parts[i].append((four, counts[i]))
        for models in alike.values():
            stepped = [one for i in models for one in parts[i]]
            if stepped:
                self._step_by_torch(stepped, self.param_groups[models[0]])

    def _step_by_torch(self, parts: _Parts, group: Dict[str, Any]) -> None:
        """Models of equal settings (`group`) stepped by torch's own Adam in the implementation asked
        for, over their parts of every wide tensor: what their torch optimizers do, kernel for
        kernel. The fused kernel reads a non-contiguous view as if it were contiguous (a joined
        part along an inner axis came out wrong): such a part is stepped as a contiguous copy."""
        fused = self.implementation == "fused"
        lists: List[List[torch.Tensor]] = [[], [], [], [], []]
        steps: List[torch.Tensor] = []
        back: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for four, count in parts:
            for into, part in zip(lists, four):
                assert part is not None
                if fused and not part.is_contiguous():
                    back.append((part, part.contiguous()))
                    part = back[-1][1]
                into.append(part)
            device = lists[0][-1].device if fused else torch.device("cpu")  # where torch's Adam keeps its count
            steps.append(torch.tensor(count, dtype=torch.float32, device=device))
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        self.TORCH_STEP(
            *lists[:4], lists[4] if amsgrad else [], steps, foreach=not fused, fused=fused, amsgrad=amsgrad,
            beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip
        for part, stepped in back:
            part.copy_(stepped)


class AdamW(Adam):
    """torch.optim.AdamW for each of the N models: Adam with its weight decay applied to the
    parameters (decoupled), default 0.01 as torch's."""

    TORCH = torch.optim.AdamW
    DECOUPLED = True
    TORCH_STEP = staticmethod(torch_adamw)

    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1e-3,
        betas: Any = (0.9, 0.999),
        eps: Any = 1e-8,
        weight_decay: Any = 1e-2,
        amsgrad: Any = False,
        implementation: Optional[str] = None,
        **others: Any,
    ):
        super().__init__(module, lr, betas, eps, weight_decay, amsgrad, implementation, **others)


class Adadelta(PerModelOptimizer):
    """torch.optim.Adadelta for each of the N models: lr, rho, eps and weight_decay, each one value
    or one per model (HFTA's third fused optimizer)."""

    TORCH: ClassVar[Type[torch.optim.Optimizer]] = torch.optim.Adadelta
    SETTINGS = {"lr": number(0.0), "rho": number(0.0, 1.0), "eps": number(0.0), "weight_decay": number(0.0)}
    MOMENTS = ("square_avg", "acc_delta")

    def __init__(
        self,
        module: nn.Module,
        lr: Any = 1.0,
        rho: Any = 0.9,
        eps: Any = 1e-6,
        weight_decay: Any = 0.0,
        implementation: Optional[str] = None,
        **others: Any,
    ):
        super().__init__(module, implementation, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, **others)

    def _numbers(self, s: Dict[str, torch.Tensor], steps: torch.Tensor) -> Dict[str, Any]:
        return {
            "decay": Numbers(s["weight_decay"]) if s["weight_decay"].any() else None,
            "rho": Numbers(s["rho"]),
            "rho_rest": Numbers(1 - s["rho"]),
            "eps": Numbers(s["eps"]),
            "lr": Numbers(s["lr"]),
        }

    def _update(
        self, p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any], layout: Layout, c: Dict[str, Any]
    ) -> None:
        """torch's single-tensor Adadelta, line by line, with each model's numbers over its part."""
        if c["decay"] is not None:  # torch: grad.add(param, alpha=weight_decay)
            g = c["decay"].add_to(g.clone(), p, layout)
        square, accumulated = state["square_avg"], state["acc_delta"]
        mul_addcmul(square, g, g, c["rho"], c["rho_rest"], layout)  # torch: square_avg's, by rho
        eps = c["eps"].over(layout, p)
        std = square.add(eps).sqrt_()
        delta = accumulated.add(eps).sqrt_().div_(std).mul_(g)
        mul_addcmul(accumulated, delta, delta, c["rho"], c["rho_rest"], layout)  # torch: acc_delta's
        c["lr"].add_to(p, delta, layout, sign=-1.0)  # torch: param.add_(delta, alpha=-lr)
