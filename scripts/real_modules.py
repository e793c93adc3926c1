"""Real layers, as they are, through benchmark_custom: which strategies apply, which wins at N.

Each layer of a transformers model is built from a tiny config in code (nothing is
downloaded) and called with its own keyword inputs: LlamaDecoderLayer gets its RoPE tables
`position_embeddings=(cos, sin)`, passed once for all N models, WhisperEncoderLayer its
attention mask left at None; the MoE blocks are made one block of N·E experts by surgery.
One row per layer: the strategies that ran correctly, those
skipped or failed (with why), the winner at N, the best strategy's speedup against the N
separate calls and against them compiled (loop_compiled), surgery's speed against vmap's,
and the seconds the run took. `--held-out` adds layers the catalogue does not name.
Pin it for quotable numbers:

    taskset -c 1 python scripts/real_modules.py [--n 16] [--threads 1] [--hidden 256 --seq 64 --batch 4]

tests/test_real_modules.py runs the same catalogue, at N=2, in inference and train_step.
"""

from __future__ import annotations

import argparse
import time
import warnings
from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Tuple

import torch
from torch import nn

from wide_tessera import benchmark_custom
from wide_tessera.reports.text import format_table


class Sizes(NamedTuple):
    """The layers' sizes: hidden 32 by default (the catalogue's tiny configs), a feed-forward of
    twice that, four heads; each input `batch` sequences of `seq` tokens."""

    hidden: int = 32
    seq: int = 6
    batch: int = 2

    def states(self) -> torch.Tensor:
        return torch.randn(self.batch, self.seq, self.hidden)

    def hidden_states(self) -> Dict[str, torch.Tensor]:
        return {"hidden_states": self.states()}


TINY = Sizes()
D = TINY.hidden


def catalogue(s: Sizes = TINY) -> Dict[str, Tuple[Callable[..., nn.Module], Dict[str, Any], Callable[[], Any]]]:
    """name -> (the layer's class, its arguments, one model's input): tiny configs, built in code."""
    h, ff = s.hidden, 2 * s.hidden
    import transformers as T
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP, LlamaRotaryEmbedding
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.t5.modeling_t5 import T5LayerFF
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    llama = T.LlamaConfig(hidden_size=h, num_attention_heads=4, num_key_value_heads=2, intermediate_size=ff)
    mixtral = T.MixtralConfig(hidden_size=h, intermediate_size=ff, num_local_experts=4, num_attention_heads=4)
    qwen_moe = T.Qwen2MoeConfig(hidden_size=h, moe_intermediate_size=h, shared_expert_intermediate_size=ff,
                                num_experts=4, num_attention_heads=4)  # fmt: skip
    rope = LlamaRotaryEmbedding(llama)(torch.zeros(1, s.seq, h), torch.arange(s.seq)[None])  # one pair for all N models

    return {
        "BertLayer": (BertLayer, {"config": T.BertConfig(hidden_size=h, num_attention_heads=4, intermediate_size=ff)},
                      s.hidden_states),
        "GPT2Block": (GPT2Block, {"config": T.GPT2Config(n_embd=h, n_head=4)}, s.hidden_states),
        "LlamaDecoderLayer": (LlamaDecoderLayer, {"config": llama, "layer_idx": 0},
                              lambda: {"hidden_states": s.states(), "position_embeddings": rope}),
        "LlamaMLP": (LlamaMLP, {"config": llama}, lambda: s.states()),
        "T5LayerFF": (T5LayerFF, {"config": T.T5Config(d_model=h, d_ff=ff, num_heads=4)}, s.hidden_states),
        "WhisperEncoderLayer": (
            WhisperEncoderLayer, {"config": T.WhisperConfig(d_model=h, encoder_attention_heads=4, encoder_ffn_dim=ff)},
            lambda: (s.states(), None),  # attention_mask left at None
        ),
        # a standalone block's experts are torch.empty: initialised as its model would
        "MixtralSparseMoeBlock": (partial(initialised, MixtralSparseMoeBlock), {"config": mixtral}, s.hidden_states),
        "Qwen2MoeSparseMoeBlock": (partial(initialised, Qwen2MoeSparseMoeBlock), {"config": qwen_moe}, s.hidden_states),
    }  # fmt: skip


def held_out(s: Sizes = TINY) -> Dict[str, Tuple[Callable[..., nn.Module], Dict[str, Any], Callable[[], Any]]]:
    """Layers the catalogue does not name, tried the same way (`--held-out`): decoder layers of
    other families (each with its own RoPE tables; Mixtral's and Qwen2-MoE's with their sparse
    MoE block inside) and encoders of text, vision and speech models."""
    h, ff = s.hidden, 2 * s.hidden
    import transformers as T
    from transformers.models.bart.modeling_bart import BartEncoderLayer
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer
    from transformers.models.distilbert.modeling_distilbert import TransformerBlock
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer, GPTNeoXRotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralRotaryEmbedding
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding
    from transformers.models.phi.modeling_phi import PhiDecoderLayer, PhiRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeRotaryEmbedding
    from transformers.models.roberta.modeling_roberta import RobertaLayer
    from transformers.models.vit.modeling_vit import ViTLayer

    def decoder(layer: type, rotary: type, config: Any) -> Tuple[Callable[..., nn.Module], Dict[str, Any], Any]:
        rope = rotary(config)(torch.zeros(1, s.seq, h), torch.arange(s.seq)[None])
        return partial(initialised, layer), {"config": config, "layer_idx": 0}, lambda: {
            "hidden_states": s.states(), "position_embeddings": rope}  # fmt: skip

    sizes = dict(hidden_size=h, num_attention_heads=4, intermediate_size=ff)
    return {
        # as from_pretrained builds it by default: attention by torch's SDPA, not eager matmuls
        "LlamaDecoderLayer/sdpa": decoder(LlamaDecoderLayer, LlamaRotaryEmbedding,
                                          T.LlamaConfig(num_key_value_heads=2, attn_implementation="sdpa", **sizes)),
        "MistralDecoderLayer": decoder(MistralDecoderLayer, MistralRotaryEmbedding,
                                       T.MistralConfig(num_key_value_heads=2, **sizes)),
        "Qwen2DecoderLayer": decoder(Qwen2DecoderLayer, Qwen2RotaryEmbedding,
                                     T.Qwen2Config(num_key_value_heads=2, **sizes)),
        "GemmaDecoderLayer": decoder(GemmaDecoderLayer, GemmaRotaryEmbedding,
                                     T.GemmaConfig(num_key_value_heads=2, head_dim=h // 4, **sizes)),
        "MixtralDecoderLayer": decoder(MixtralDecoderLayer, MixtralRotaryEmbedding,
                                       T.MixtralConfig(num_key_value_heads=2, num_local_experts=4, **sizes)),
        "Qwen2MoeDecoderLayer": decoder(Qwen2MoeDecoderLayer, Qwen2MoeRotaryEmbedding,
                                        T.Qwen2MoeConfig(num_key_value_heads=2, num_experts=4, moe_intermediate_size=h,
                                                         shared_expert_intermediate_size=ff, **sizes)),
        "PhiDecoderLayer": decoder(PhiDecoderLayer, PhiRotaryEmbedding, T.PhiConfig(**sizes)),
        "GPTNeoXLayer": decoder(GPTNeoXLayer, GPTNeoXRotaryEmbedding, T.GPTNeoXConfig(**sizes)),
        "RobertaLayer": (RobertaLayer, {"config": T.RobertaConfig(**sizes)}, s.hidden_states),
        "ViTLayer": (ViTLayer, {"config": T.ViTConfig(**sizes)}, s.hidden_states),
        "CLIPEncoderLayer": (CLIPEncoderLayer, {"config": T.CLIPVisionConfig(**sizes)},
                             lambda: (s.states(), None)),
        "BartEncoderLayer": (BartEncoderLayer, {"config": T.BartConfig(d_model=h, encoder_attention_heads=4,
                                                                       encoder_ffn_dim=ff)},
                             lambda: (s.states(), None)),
        "DistilBertBlock": (TransformerBlock, {"config": T.DistilBertConfig(dim=h, n_heads=4, hidden_dim=ff)},
                            s.hidden_states),
    }  # fmt: skip


def moe_families(s: Sizes = TINY) -> Dict[str, Tuple[Callable[..., nn.Module], Dict[str, Any], Callable[[], Any]]]:
    """Sparse MoE blocks the catalogue does not name, and a decoder layer holding each (`--held-out`):
    recognised by their structure (a router of E experts beside the E experts stacked), whatever
    their attributes are called. SwitchTransformers' experts are a ModuleDict, not stacked."""
    h, ff = s.hidden, 2 * s.hidden
    import transformers as T
    from transformers.models.dbrx.modeling_dbrx import DbrxBlock, DbrxFFN, DbrxRotaryEmbedding
    from transformers.models.granitemoe.modeling_granitemoe import (
        GraniteMoeDecoderLayer,
        GraniteMoeMoE,
        GraniteMoeRotaryEmbedding,
    )
    from transformers.models.jamba.modeling_jamba import JambaAttentionDecoderLayer, JambaSparseMoeBlock
    from transformers.models.phimoe.modeling_phimoe import (
        PhimoeDecoderLayer,
        PhimoeRotaryEmbedding,
        PhimoeSparseMoeBlock,
    )
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

    def decoder(layer: type, rotary: type, config: Any) -> Tuple[Callable[..., nn.Module], Dict[str, Any], Any]:
        rope = rotary(config)(torch.zeros(1, s.seq, h), torch.arange(s.seq)[None])
        return partial(initialised, layer), {"config": config, "layer_idx": 0}, lambda: {
            "hidden_states": s.states(), "position_embeddings": rope}  # fmt: skip

    sizes = dict(hidden_size=h, num_attention_heads=4, num_key_value_heads=2, intermediate_size=ff)
    # transformers 5.24's DbrxAttention reads rope_theta and clamps by clip_qkv, neither defaulted
    dbrx = T.DbrxConfig(d_model=h, n_heads=4, attn_config={"rope_theta": 1e4, "kv_n_heads": 2, "clip_qkv": 8.0},
                        ffn_config={"ffn_hidden_size": ff, "moe_num_experts": 4, "moe_top_k": 2})  # fmt: skip
    granite = T.GraniteMoeConfig(num_local_experts=4, **sizes)
    jamba = T.JambaConfig(num_experts=4, expert_layer_period=1, expert_layer_offset=0, **sizes)
    phimoe = T.PhimoeConfig(num_local_experts=4, **sizes)
    switch = T.SwitchTransformersConfig(d_model=h, d_ff=ff, num_experts=4, num_heads=4, d_kv=h // 4)
    return {
        "DbrxFFN": (partial(initialised, DbrxFFN), {"config": dbrx}, lambda: s.states()),
        "DbrxBlock": decoder(DbrxBlock, DbrxRotaryEmbedding, dbrx),
        "GraniteMoeMoE": (partial(initialised, GraniteMoeMoE), {"config": granite}, lambda: s.states()),
        "GraniteMoeDecoderLayer": decoder(GraniteMoeDecoderLayer, GraniteMoeRotaryEmbedding, granite),
        "JambaSparseMoeBlock": (partial(initialised, JambaSparseMoeBlock), {"config": jamba}, s.hidden_states),
        "JambaAttentionDecoderLayer": (partial(initialised, JambaAttentionDecoderLayer),
                                       {"config": jamba, "layer_idx": 0}, s.hidden_states),
        "PhimoeSparseMoeBlock": (partial(initialised, PhimoeSparseMoeBlock), {"config": phimoe}, s.hidden_states),
        "PhimoeDecoderLayer": decoder(PhimoeDecoderLayer, PhimoeRotaryEmbedding, phimoe),
        "SwitchTransformersSparseMLP": (partial(initialised, SwitchTransformersSparseMLP), {"config": switch},
                                        s.hidden_states),
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
    parser.add_argument("--held-out", action="store_true", help="also the layers of held_out() and moe_families()")
    parser.add_argument("--hidden", type=int, default=TINY.hidden, help="hidden size (a multiple of 4: four heads)")
    parser.add_argument("--seq", type=int, default=TINY.seq, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=TINY.batch, help="sequences per input")
    parser.add_argument("--layers", help="only these layers, comma-separated names")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # a standalone layer's note on its attention implementation
    rows = []
    sizes = Sizes(args.hidden, args.seq, args.batch)
    layers = {**catalogue(sizes), **({**held_out(sizes), **moe_families(sizes)} if args.held_out else {})}
    if args.layers:
        unknown = set(args.layers.split(",")) - set(layers)
        if unknown:
            parser.error(f"--layers: no layer named {', '.join(sorted(unknown))}; known: {', '.join(layers)}")
        layers = {k: v for k, v in layers.items() if k in args.layers.split(",")}
    for name, (cls, kwargs, inputs) in layers.items():
        started = time.perf_counter()
        r = benchmark_custom(cls, None, [args.n], model_kwargs=kwargs, input_factory=inputs, verbose=False)
        p = r.points[0]
        ran = [s for s in r.strategies if p.correct.get(s)]
        not_ran = [f"{s}: {p.failures[s].kind}" for s in r.strategies if s in p.failures]
        best = p.best_strategy
        vs_loop = f"{p.speedups[best]:.2f}x" if best in p.speedups else "-"
        compiled = p.timings.get("loop_compiled")
        vs_compiled = f"{compiled / p.timings[best]:.2f}x" if compiled and best in p.timings else "-"
        both = all(s in p.timings for s in ("vmap", "surgery"))
        surgery_vs_vmap = f"{p.timings['vmap'] / p.timings['surgery']:.2f}x" if both else "-"
        rows.append([name, ", ".join(ran), "; ".join(not_ran) or "-", p.winner or "-", best or "-", vs_loop,
                     vs_compiled, surgery_vs_vmap, f"{time.perf_counter() - started:.0f}"])  # fmt: skip
    print(f"N={args.n}, hidden {sizes.hidden}, {sizes.batch} x {sizes.seq} tokens, "
          f"{torch.get_num_threads()} thread(s), {r.environment.device_name}, torch {torch.__version__}")
    header = ["layer", "correct", "not run", f"winner at N={args.n}", "best", "vs loop", "vs loop_compiled",
              "surgery vs vmap", "s"]  # fmt: skip
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
