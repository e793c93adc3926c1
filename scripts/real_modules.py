"""Real layers, as they are, through benchmark_custom: which strategies apply, which wins at N.

Each layer of a transformers model is built from a tiny config in code (nothing is
downloaded) and called with its own keyword inputs: LlamaDecoderLayer gets its RoPE tables
`position_embeddings=(cos, sin)`, passed once for all N models, WhisperEncoderLayer its
attention mask left at None; the MoE blocks are made one block of N·E experts by surgery.
One row per layer: the strategies that ran correctly, those
skipped or failed (with why), the winner at N, the best strategy's speedup against the N
separate calls and against them compiled (loop_compiled), and the seconds the run took.
Pin it for quotable numbers:

    taskset -c 1 python scripts/real_modules.py [--n 16] [--threads 1]

tests/test_real_modules.py runs the same catalogue, at N=2, in inference and train_step.
"""

from __future__ import annotations

import argparse
import time
import warnings
from functools import partial
from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

from wide_tessera import benchmark_custom
from wide_tessera.reports.text import format_table

D = 32


def catalogue() -> Dict[str, Tuple[Callable[..., nn.Module], Dict[str, Any], Callable[[], Any]]]:
    """name -> (the layer's class, its arguments, one model's input): tiny configs, built in code."""
    import transformers as T
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP, LlamaRotaryEmbedding
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.t5.modeling_t5 import T5LayerFF
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    llama = T.LlamaConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    mixtral = T.MixtralConfig(hidden_size=D, intermediate_size=64, num_local_experts=4, num_attention_heads=4)
    qwen_moe = T.Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                num_experts=4, num_attention_heads=4)  # fmt: skip
    rope = LlamaRotaryEmbedding(llama)(torch.zeros(1, 6, D), torch.arange(6)[None])  # one pair for all N models

    def hidden() -> Dict[str, torch.Tensor]:
        return {"hidden_states": torch.randn(2, 6, D)}

    return {
        "BertLayer": (BertLayer, {"config": T.BertConfig(hidden_size=D, num_attention_heads=4, intermediate_size=64)},
                      hidden),
        "GPT2Block": (GPT2Block, {"config": T.GPT2Config(n_embd=D, n_head=4)}, hidden),
        "LlamaDecoderLayer": (LlamaDecoderLayer, {"config": llama, "layer_idx": 0},
                              lambda: {"hidden_states": torch.randn(2, 6, D), "position_embeddings": rope}),
        "LlamaMLP": (LlamaMLP, {"config": llama}, lambda: torch.randn(2, 6, D)),
        "T5LayerFF": (T5LayerFF, {"config": T.T5Config(d_model=D, d_ff=64, num_heads=4)}, hidden),
        "WhisperEncoderLayer": (
            WhisperEncoderLayer, {"config": T.WhisperConfig(d_model=D, encoder_attention_heads=4, encoder_ffn_dim=64)},
            lambda: (torch.randn(2, 6, D), None),  # attention_mask left at None
        ),
        # a standalone block's experts are torch.empty: initialised as its model would
        "MixtralSparseMoeBlock": (partial(initialised, MixtralSparseMoeBlock), {"config": mixtral}, hidden),
        "Qwen2MoeSparseMoeBlock": (partial(initialised, Qwen2MoeSparseMoeBlock), {"config": qwen_moe}, hidden),
    }  # fmt: skip


def initialised(cls: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    """`cls(**kwargs)` with every parameter drawn from N(0, 0.2), as from_pretrained would fill it."""
    model = cls(**kwargs)
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # a standalone layer's note on its attention implementation
    rows = []
    for name, (cls, kwargs, inputs) in catalogue().items():
        started = time.perf_counter()
        r = benchmark_custom(cls, None, [args.n], model_kwargs=kwargs, input_factory=inputs, verbose=False)
        p = r.points[0]
        ran = [s for s in r.strategies if p.correct.get(s)]
        not_ran = [f"{s}: {p.failures[s].kind}" for s in r.strategies if s in p.failures]
        best = p.best_strategy
        vs_loop = f"{p.speedups[best]:.2f}x" if best in p.speedups else "-"
        compiled = p.timings.get("loop_compiled")
        vs_compiled = f"{compiled / p.timings[best]:.2f}x" if compiled and best in p.timings else "-"
        rows.append([name, ", ".join(ran), "; ".join(not_ran) or "-", p.winner or "-", best or "-", vs_loop,
                     vs_compiled, f"{time.perf_counter() - started:.0f}"])  # fmt: skip
    print(f"N={args.n}, {torch.get_num_threads()} thread(s), {r.environment.device_name}, torch {torch.__version__}")
    header = ["layer", "correct", "not run", f"winner at N={args.n}", "best", "vs loop", "vs loop_compiled", "s"]
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
