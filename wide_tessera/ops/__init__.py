"""The built-in ops; importing this package registers them."""

# Registration order is the order `wide_tessera list` and `--all` use.
from .gemm import WideLinear  # isort: skip
from .conv import WideConv1d, WideConv2d, WideConv3d, WideConvTranspose2d  # isort: skip
from .attention import AttentionBlock, WideAttention  # isort: skip
from .experts import Expert, WideExperts  # isort: skip
from .hf_experts import WideHFExperts  # isort: skip
from .mlp import WideMLP  # isort: skip
from .norms import (
    WideBatchNorm1d,
    WideBatchNorm2d,
    WideGroupNorm,
    WideInstanceNorm1d,
    WideInstanceNorm2d,
    WideLayerNorm,
)  # isort: skip

from .embedding import WideEmbedding  # isort: skip
from .recurrent import WideGRU, WideLSTM  # isort: skip
from .lora import LoRALinear, WideLoRA  # isort: skip
from .base import WideOp

__all__ = [
    "WideOp",
    "WideLinear",
    "WideConv1d",
    "WideConv2d",
    "WideConv3d",
    "WideConvTranspose2d",
    "AttentionBlock",
    "WideAttention",
    "Expert",
    "WideExperts",
    "WideHFExperts",
    "WideMLP",
    "WideLayerNorm",
    "WideBatchNorm1d",
    "WideBatchNorm2d",
    "WideInstanceNorm1d",
    "WideInstanceNorm2d",
    "WideGroupNorm",
    "WideEmbedding",
    "WideGRU",
    "WideLSTM",
    "LoRALinear",
    "WideLoRA",
]
