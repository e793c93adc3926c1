"""N embedding tables, each looked up with its own token ids: integer inputs."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import WideTesseraError
from ..core.job import SweepParams, Work
from ..core.layout import load_joined
from .alike import shared_config
from .base import WideOp, itemsize
from .registry import register

__all__ = ["WideEmbedding"]


@register("embedding")
class WideEmbedding(WideOp, nn.Module):
    """N nn.Embedding(vocab, dim). Wide layout: ids [N, ...] (integers), output [N, ..., dim].

    The N tables are one parameter [N, vocab, dim]. Strategies: 'offset' (the tables seen as
    one of N*vocab rows, each model's ids shifted by its offset, one F.embedding); 'gather'
    (advanced indexing of the stacked tables by model and id). A `padding_idx` row gets no
    gradient, as in nn.Embedding: one lookup of N tables cannot name N padding rows, so the
    looked-up rows of padding ids are detached (a transformers model's embedding has one; the
    stacked lookup without it gave the padding row a gradient, and a trained Bert drifted).
    """

    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of([1, 4, 16], batch=[8], seq_len=[32], vocab=[1000], dim=[64], dtype=["float32"]),
        "quick": SweepParams.of(
            [1, 2, 4, 8, 16, 32], batch=[16], seq_len=[64], vocab=[4096], dim=[128], dtype=["float32", "bfloat16"]
        ),
        "full": SweepParams.of(
            [1, 2, 4, 8, 16, 32, 64],
            batch=[16, 64],
            seq_len=[128],
            vocab=[4096, 32768],
            dim=[128, 512],
            dtype=["float32", "bfloat16", "float16"],
        ),
    }
    BENCHMARK_STRATEGIES = ("offset", "gather")
    FUSES = nn.Embedding

    def __init__(
        self, n: int, vocab: int, dim: int, strategy: Optional[str] = None, padding_idx: Optional[int] = None
    ):
        super().__init__()
        self.n, self.vocab, self.dim, self.padding_idx = n, vocab, dim, padding_idx
        self.strategy = self.check_strategy(strategy)
        self.weight = nn.Parameter(torch.empty(n, vocab, dim))

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideEmbedding":
        config = shared_config(
            modules,
            nn.Embedding,
            lambda m: dict(
                vocab=m.num_embeddings,
                dim=m.embedding_dim,
                max_norm=m.max_norm,
                sparse=m.sparse,
                scale_grad_by_freq=m.scale_grad_by_freq,
                padding_idx=m.padding_idx,
            ),
        )
        # (scale_grad_by_freq was ignored: every model's gradient off, by up to 12.7)
        if config.pop("max_norm") is not None or config.pop("sparse") or config.pop("scale_grad_by_freq"):
            raise WideTesseraError(
                "WideEmbedding fuses embeddings without max_norm (it renormalizes in place), sparse gradients or "
                "scale_grad_by_freq"
            )
        return load_joined(cls(len(modules), strategy=strategy, **config), modules)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype.is_floating_point:
            raise WideTesseraError(f"WideEmbedding takes integer token ids, got {ids.dtype}")
        models = torch.arange(self.n, device=ids.device).view(self.n, *(1,) * (ids.dim() - 1))
        if self.strategy == "gather":
            rows = self.weight[models, ids]
        else:
            rows = F.embedding(ids + models * self.vocab, self.weight.view(self.n * self.vocab, self.dim))
        if self.padding_idx is None or not rows.requires_grad:
            return rows
        padding = (ids == self.padding_idx % self.vocab).unsqueeze(-1)
        return torch.where(padding, rows.detach(), rows)

    @classmethod
    def work(cls, n: int, batch: int, seq_len: int, dim: int, **params: Any) -> Work:
        # no arithmetic; the looked-up rows read and written, the ids read
        return Work(0.0, float(n * batch * seq_len * (2 * dim * itemsize(params) + 8)))

    @classmethod
    def module_params(cls, module: nn.Module) -> Dict[str, Any]:
        return dict(vocab=module.num_embeddings, dim=module.embedding_dim)

    @classmethod
    def bench_model(cls, vocab: int, dim: int, **_: Any) -> nn.Module:
        return nn.Embedding(vocab, dim)

    @classmethod
    def bench_inputs(cls, n: int, batch: int, seq_len: int, vocab: int, **_: Any) -> List[torch.Tensor]:
        return [torch.randint(0, vocab, (batch, seq_len)) for _ in range(n)]
