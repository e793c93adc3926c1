"""N LoRA adapters over one shared frozen base: the copies served and trained together most.

One model is one adapted layer, y = x W^T + b + scaling * (dropout(x) A^T) B^T, whose base
(W, b) is frozen and is the same module in all N models, as N adapters of one served model
share it. The baseline's N calls each run the base on their own batch; every strategy runs the
base once over the N batches folded together (one GEMM over all their tokens) and differs in
how it runs the N small adapters. The wide layout is every adapter's tokens, one after another,
[tokens, hidden]; `pack` records how many each adapter has.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core.capabilities import Needs, Probe
from ..core.errors import NotApplicable, WideTesseraError
from ..core.job import SweepParams, Work
from ..core.layout import SHARED, STACKED, Slot
from .base import TRITON, WideOp, itemsize
from .exact import times
from .experts import grouped_mm_probe, routing_sizes
from .registry import register

__all__ = ["LoRALinear", "WideLoRA", "SPLITS", "PEFT_MISSING"]

PEFT_MISSING = "needs peft (pip install peft)"
# How the tokens are shared among the adapters: all alike, or Zipf-skewed (routing_sizes, exponent
# 1: at N=16 the busiest adapter gets 11 times the tokens of the idlest), as a server's requests are.
SPLITS = {"uniform": 0.0, "ragged": 1.0}


class LoRALinear(nn.Module):
    """One adapted linear layer: `base` (frozen; shared between adapters) plus `lora_B(lora_A(
    dropout(x))) * scaling`, named as PEFT names one adapter's weights."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lora_B(self.lora_A(self.dropout(x)))
        # a scaling held per model (widen.rates) is a tensor: multiplied as the float is
        return self.base(x) + (h * self.scaling if isinstance(self.scaling, float) else times(h, self.scaling))


@lru_cache(maxsize=1)
def shared_base(hidden: int) -> nn.Linear:
    """The frozen base of one point's N models, one module for all: their `.to()` then moves it
    once, and the baseline's N calls read one base, as a server's do. Cached by size, so every
    model of a point is built on the same one."""
    base = nn.Linear(hidden, hidden)
    base.requires_grad_(False)
    return base


def _uniform_only(strategy: str) -> Probe:
    def probe(device: torch.device, dtype: torch.dtype, params: Dict[str, Any]) -> Optional[str]:
        if params.get("split") != "uniform":
            return f"needs as many tokens for every adapter ({strategy}); this point's split is {params.get('split')}"
        return None

    return probe


def _peft_unavailable(device: torch.device, dtype: torch.dtype, params: Dict[str, Any]) -> Optional[str]:
    if importlib.util.find_spec("peft") is None:
        return PEFT_MISSING
    # PEFT's mixed batch gives each sequence of a padded batch one adapter: equal lengths
    return _uniform_only("PEFT's adapter_names= takes one adapter per sequence of a batch")(device, dtype, params)


@register("lora")
class WideLoRA(WideOp, nn.Module):
    """N LoRA adapters of rank `rank` over one base nn.Linear, adapter i on its own tokens.

    Strategies: 'bmm' (the adapters as two batched matmuls; as many tokens per adapter),
    'grouped_mm' (torch._grouped_mm over the ragged segments, where this torch and device have
    it), 'peft' (PEFT's own mixed-adapter forward, `adapter_names=`; inference only, as PEFT
    allows), 'triton' (the Triton segmented shrink and expand, wide_tessera.kernels.segmented_lora;
    CUDA, inference only). Every one runs the base once over all the tokens.
    """

    BENCHMARK_STRATEGIES = ("bmm", "grouped_mm", "peft", "triton")
    STRATEGY_NEEDS = {
        "bmm": Needs(probe=_uniform_only("two batched matmuls over the stacked adapters")),
        "grouped_mm": Needs(probe=grouped_mm_probe("hidden", "rank"), compiled_dtypes=("bfloat16",)),
        "peft": Needs(probe=_peft_unavailable),
        "triton": TRITON,
    }
    # The quick preset adds about 7 s to the README's run of every op's quick preset (2-core CPU).
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of(
            [2, 8], hidden=[64], rank=[8], tokens=[16], split=["uniform", "ragged"], dtype=["float32"]
        ),
        "quick": SweepParams.of(
            [4, 16], hidden=[256], rank=[16], tokens=[32], split=["uniform", "ragged"], dtype=["float32", "bfloat16"]
        ),
        "full": SweepParams.of(
            [4, 16, 64],
            hidden=[1024, 4096],
            rank=[8, 64],
            tokens=[16, 256],
            split=["uniform", "ragged"],
            dtype=["float32", "bfloat16"],
        ),
    }

    def __init__(
        self,
        base: nn.Linear,
        n: int,
        rank: int,
        scaling: Sequence[float],
        dropout: Sequence[float] = (),
        strategy: Optional[str] = None,
    ):
        super().__init__()
        self.n, self.rank = n, rank
        self.strategy = self.check_strategy(strategy)
        self.base = base  # one module, the N models' own: not a copy
        weight = base.weight
        self.lora_A = nn.Parameter(weight.new_empty(n, rank, base.in_features))
        self.lora_B = nn.Parameter(weight.new_empty(n, base.out_features, rank))
        scales = torch.tensor([float(s) for s in scaling], dtype=torch.float64, device=weight.device)
        self.register_buffer("scaling", scales, persistent=False)  # float64: each a Python float's value
        self.dropout = [float(p) for p in dropout] or [0.0] * n
        # None: as many tokens for every adapter, whatever comes (a model's stacked batches)
        self.sizes: Optional[List[int]] = None
        self.register_buffer("group_sizes", torch.zeros(n, dtype=torch.int32, device=weight.device), persistent=False)
        # PEFT's model of the same tensors (the 'peft' strategy), held outside the module tree: its
        # adapters are copies, which state_dict, .to() and the models given back must not see; it is
        # built again whenever the adapters it copied have changed (`_peft`).
        self._peft_built: Tuple[Any, ...] = ()

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideLoRA":
        if not isinstance(modules, (list, tuple, nn.ModuleList)) or not modules:
            raise WideTesseraError("from_modules needs a list of LoRALinear modules, got none")
        first = modules[0]
        for i, m in enumerate(modules):
            if not isinstance(m, LoRALinear):
                raise WideTesseraError(f"module {i} is a {type(m).__name__}; expected LoRALinear")
            if not _same_base(m.base, first.base):
                raise WideTesseraError(
                    f"module {i}'s base differs from module 0's: the N adapters must share one frozen base"
                )
            if m.lora_A.out_features != first.lora_A.out_features:
                raise WideTesseraError(
                    f"module {i} has rank {m.lora_A.out_features} but module 0 rank {first.lora_A.out_features}: "
                    "fuse adapters of one rank together"
                )
        scaling, dropout = [m.scaling for m in modules], [m.dropout.p for m in modules]
        wide = cls(first.base, len(modules), first.lora_A.out_features, scaling, dropout, strategy)
        with torch.no_grad():
            wide.lora_A.copy_(torch.stack([m.lora_A.weight for m in modules]))
            wide.lora_B.copy_(torch.stack([m.lora_B.weight for m in modules]))
        wide.lora_A.requires_grad_(first.lora_A.weight.requires_grad)
        wide.lora_B.requires_grad_(first.lora_B.weight.requires_grad)
        if wide.strategy in ("peft", "triton") and first.training:
            why = "PEFT refuses adapter_names= in training" if wide.strategy == "peft" else "the kernel has no backward"
            raise NotApplicable(f"inference only ({why})")
        return wide

    def model_slots(self) -> Dict[str, Slot]:
        """The adapters, stacked; the base, one module every model shares."""
        base = {f"base.{k}": Slot(f"base.{k}", SHARED) for k in self.base.state_dict()}
        return {**base, "lora_A": Slot("lora_A.weight", STACKED), "lora_B": Slot("lora_B.weight", STACKED)}

    def pack(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every adapter's tokens one after another; records how many each has."""
        if not isinstance(inputs, (list, tuple)) or len(inputs) != self.n:
            raise WideTesseraError(f"pack needs a list of {self.n} token tensors, one per adapter")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.base.in_features:
                raise WideTesseraError(f"pack: input {i} must be a [tokens, {self.base.in_features}] tensor")
        self.sizes = [x.shape[0] for x in inputs]
        self.group_sizes = torch.tensor(self.sizes, dtype=torch.int32, device=inputs[0].device)
        return torch.cat(list(inputs))

    def unpack(self, output: torch.Tensor) -> List[torch.Tensor]:
        return list(output.split(self.sizes or output.shape[0] // self.n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in] (or [N * batch, ..., in]: as many tokens per adapter) -> [..., out]."""
        lead = x.shape[:-1]
        x = x.reshape(-1, self.base.in_features)
        if self.strategy == "peft":  # PEFT runs the base itself
            return self._peft(x).reshape(*lead, -1)
        y = self.base(x)  # the base once, over the N batches folded
        if self.strategy == "triton":
            from ..kernels import segmented_lora

            y = segmented_lora(y, x, self.lora_A, self.lora_B, self.scaling, self._group_sizes(x.shape[0]))
            return y.reshape(*lead, -1)
        x = self._dropped(x).to(self.lora_A.dtype)  # PEFT keeps a half base's adapters in float32
        if self.strategy == "grouped_mm":
            sizes = self._group_sizes(x.shape[0])
            offsets = sizes.cumsum(0, dtype=torch.int32)
            h = torch._grouped_mm(x, self.lora_A.transpose(1, 2), offs=offsets)
            h = times(h, self.scaling.repeat_interleave(sizes, output_size=x.shape[0])[:, None])
            h = torch._grouped_mm(h, self.lora_B.transpose(1, 2), offs=offsets)
            return (y + h.to(y.dtype)).reshape(*lead, -1)
        h = torch.bmm(x.view(self.n, -1, x.shape[-1]), self.lora_A.transpose(1, 2))
        h = times(h, self.scaling[:, None, None])
        return (y + torch.bmm(h, self.lora_B.transpose(1, 2)).view(y.shape).to(y.dtype)).reshape(*lead, -1)

    def _group_sizes(self, tokens: int) -> torch.Tensor:
        """Each adapter's token count, [N] on the module's device: pack's, else an equal share."""
        if self.sizes is None:
            return torch.full_like(self.group_sizes, tokens // self.n)
        return self.group_sizes

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """x with each adapter's dropout on its own tokens (training only)."""
        if not self.training or not any(self.dropout):
            return x
        p = torch.tensor(self.dropout, device=x.device, dtype=x.dtype)
        p = p.repeat_interleave(self._group_sizes(x.shape[0]), output_size=x.shape[0])[:, None]
        return x * (torch.rand_like(x) >= p) / (1 - p)

    def _peft(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's mixed batch: the N batches as N sequences, each named with its adapter."""
        made_of = tuple((t, t._version, t.device, t.dtype) for t in (self.lora_A, self.lora_B, *self.base.parameters()))
        if not self._peft_built or any(
            a is not b or va != vb or da != db or ta != tb
            for (a, va, da, ta), (b, vb, db, tb) in zip(self._peft_built[1], made_of)
        ):
            self._peft_built = (_peft_model(self), made_of)
        names = [f"adapter{i}" for i in range(self.n)]
        return self._peft_built[0](x.view(self.n, -1, x.shape[-1]), adapter_names=names)

    @classmethod
    def work(cls, n: int, hidden: int, rank: int, tokens: int, **params: Any) -> Work:
        # the base once over all tokens, then each adapter's two thin products; x and y once each
        t = n * tokens
        weights = hidden * hidden + hidden + n * 2 * rank * hidden
        return Work(2.0 * t * hidden * (hidden + 2 * rank), float((2 * t * hidden + weights) * itemsize(params)))

    @classmethod
    def bench_model(cls, hidden: int, rank: int, **_: Any) -> nn.Module:
        model = LoRALinear(shared_base(hidden), rank, alpha=2.0 * rank)
        nn.init.normal_(model.lora_B.weight, std=rank**-0.5)  # PEFT's zeros would check nothing
        return model

    @classmethod
    def bench_inputs(cls, n: int, hidden: int, tokens: int, split: str, **_: Any) -> List[torch.Tensor]:
        return [torch.randn(size, hidden) for size in routing_sizes(n, tokens * n, SPLITS[split])]

    @classmethod
    def check_params(cls, split: str, **params: Any) -> None:
        if split not in SPLITS:
            raise WideTesseraError(f"split={split!r}: give one of {', '.join(SPLITS)}")


def _same_base(a: nn.Linear, b: nn.Linear) -> bool:
    """Whether two adapters' bases are one: the same module, or frozen copies of equal values (a
    training mode's per-strategy copies of the models); the wide module holds module 0's."""
    if a is b:
        return True
    ours, theirs = list(a.parameters()), list(b.parameters())
    if len(ours) != len(theirs) or any(p.requires_grad for p in ours + theirs):
        return False
    return all(torch.equal(p, q) for p, q in zip(ours, theirs))


def _peft_model(wide: WideLoRA) -> nn.Module:
    """The wide module's base and adapters as PEFT holds them: one LoRA layer over the base, adapter
    i named adapter{i}, run by PeftModel's forward."""
    from peft import LoraConfig, get_peft_model

    holder = nn.Sequential()
    holder.add_module("base", wide.base)
    model: Any = None
    for i in range(wide.n):
        alpha = float(wide.scaling[i]) * wide.rank
        config = LoraConfig(r=wide.rank, lora_alpha=alpha, target_modules=["base"], lora_dropout=wide.dropout[i])
        if model is None:
            model = get_peft_model(holder, config, adapter_name=f"adapter{i}")
        else:
            model.add_adapter(f"adapter{i}", config)
    layer = model.base_model.model.base
    with torch.no_grad():
        for i in range(wide.n):
            layer.lora_A[f"adapter{i}"].weight.copy_(wide.lora_A[i])
            layer.lora_B[f"adapter{i}"].weight.copy_(wide.lora_B[i])
    return model.eval()
