"""What every vmap over the models' own code goes through: which values it maps (a tensor all
models share goes in once), the one-line refusals of what vmap cannot run, embeddings' padding
rows kept without gradient, and outputs holding more than tensors."""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..core import trees
from ..core.errors import NotApplicable, WideTesseraError, vmap_limitation
from .stacked import is_shared

__all__ = ["vmap_dims", "under_vmap", "pads_embeddings", "EMBEDDINGS", "tensors_only", "with_others"]


def vmap_dims(tree: Any) -> Tuple[Any, Any]:
    """(the wide values, vmap's in_dims for them): a stacked tensor is mapped over its N axis; a
    shared one (expanded, stride 0 on N) goes in once, unmapped; what is not a tensor is passed as it is."""

    def value(x: Any) -> Any:
        return x[0] if is_shared(x) else x

    def dim(x: Any) -> Optional[int]:
        return 0 if isinstance(x, torch.Tensor) and not is_shared(x) else None

    return tree_map(value, tree), tree_map(dim, tree)


@contextmanager
def under_vmap(randomness: str, pads: bool = False) -> Iterator[Optional["_PaddingWithoutGradient"]]:
    """What every vmap over the models' own code runs inside:

    * torch's vmap refusing what it was given said in one line (core.errors.vmap_limitation);
    * a vmap refusing a draw under randomness='error' said in one line, with what to give instead:
      fuse() or WideSurgery of models with dropout in training raised torch's 80-line traceback
      (benchmark_custom says it before measuring);
    * where the code may look embeddings up with a padding_idx (`pads`), in training, lookups that
      give the padding row no gradient in every model (_PaddingWithoutGradient, yielded: whether it
      `saw` one). Not elsewhere: a mode sees every torch call, and cost a BertLayer's training step
      under vmap about 10% (N=8, one thread)."""
    mode = _PaddingWithoutGradient() if pads and torch.is_grad_enabled() else None
    try:
        with mode if mode is not None else nullcontext():
            yield mode
    except RuntimeError as e:
        limitation = vmap_limitation(e)
        if limitation is not None:  # nonzero, .item(), a bidirectional GRU: torch's 30-line traceback
            raise NotApplicable(limitation) from None
        if randomness != "error" or "called random operation while in randomness error mode" not in str(e):
            raise
        raise WideTesseraError(
            "the models draw random numbers (dropout in train mode?): give randomness='different' (each model its "
            "own draws) or 'same' (one draw for all)"
        ) from None


class _PaddingWithoutGradient(TorchFunctionMode):
    """Embedding lookups with a padding_idx, their padding tokens' rows taken without gradient.

    torch's vmap of an embedding looks the N models' indices up in their tables flattened into
    one, and its padding_idx stays one row of that: in training, every model but the first gave
    its padding row a gradient (a tiny LlamaForCausalLM with pad_token_id=0,
    fused by vmap, clipped by per-model norms of [1.56, 11.70, 3.49, 1.93] where torch's were
    [1.56, 2.28, 1.56, 1.67]). Looked up without padding_idx, with the padding tokens' outputs
    detached, each model's gradient is torch's: no lookup of a padding token reaches its row,
    and a row tied to another layer (an LM head) still gets that layer's gradient."""

    saw = False  # a lookup with a padding_idx

    def __torch_function__(self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        self.saw = self.saw or func in EMBEDDINGS
        if func is F.embedding and torch.is_grad_enabled():
            bound = _EMBEDDING.bind(*args, **kwargs).arguments
            padding = bound.pop("padding_idx", None)
            if padding is not None:
                out = func(**bound)
                return _detached_at(out, bound["input"], padding % bound["weight"].shape[0])
        if func in EMBEDDINGS[1:] and torch.is_grad_enabled():
            weight, indices = args[:2]
            padding = args[2] if len(args) > 2 else kwargs.pop("padding_idx", -1)
            if padding >= 0:  # aten's -1: none
                return _detached_at(func(weight, indices, -1, *args[3:], **kwargs), indices, padding)
        return func(*args, **kwargs)


_EMBEDDING = inspect.signature(F.embedding)
EMBEDDINGS = (F.embedding, torch.embedding, torch.ops.aten.embedding.default)


def pads_embeddings(module: nn.Module) -> bool:
    """Whether `module` holds an embedding with a padding_idx (nn.Embedding, its subclasses, nn.EmbeddingBag)."""
    return any(getattr(m, "padding_idx", None) is not None for m in module.modules())


def _detached_at(out: torch.Tensor, indices: torch.Tensor, padding: int) -> torch.Tensor:
    return torch.where((indices == padding).unsqueeze(-1), out.detach(), out)


def tensors_only(fn: Callable[..., Any], kept: List[Any]) -> Callable[..., Tuple[torch.Tensor, ...]]:
    """`fn` returning only its output's tensors, as vmap needs; `kept` gets (structure, other leaves)."""

    def call(*args: Any, **kwargs: Any) -> Tuple[torch.Tensor, ...]:
        leaves, structure = trees.flat(fn(*args, **kwargs))  # a DynamicCache's tensors too: none escapes vmap
        kept[:] = [structure, [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]]
        return tuple(t for t in leaves if isinstance(t, torch.Tensor))

    return call


def with_others(tensors: Sequence[torch.Tensor], kept: List[Any]) -> Any:
    """The output tensors_only split, whole again."""
    structure, others = kept
    stream = iter(tensors)
    return trees.unflat([next(stream) if o is _TENSOR else o for o in others], structure)


_TENSOR = object()  # where tensors_only took a tensor out (an output may hold None itself)
