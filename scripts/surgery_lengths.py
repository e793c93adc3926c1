"""Does surgery reuse one capture as a sequence grows, as generate() feeds a decoder?

N Llama decoder layers (tiny config built in code) fused by surgery, called at every length
from 1 to L, each length twice: the first call at a new length against the repeat call at that
length, the captures kept, the process's resident memory after the first lengths and at the
end, and every output checked against the N separate calls. Targets (issue 49): a first call
at a new length at most 2x a repeat call, at most 2 captures, memory flat. Pin it:

    taskset -c 1 python scripts/surgery_lengths.py [--n 8] [--lengths 64] [--hidden 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import List

import psutil
import torch

from wide_tessera.reports.text import format_table
from wide_tessera.widen.surgery import WideSurgery


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--lengths", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    import transformers as T
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    torch.set_num_threads(1)
    d = args.hidden
    config = T.LlamaConfig(hidden_size=d, num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * d)
    models = [LlamaDecoderLayer(config, 0).eval() for _ in range(args.n)]
    rotary = LlamaRotaryEmbedding(config)
    wide = WideSurgery(models)
    first: List[float] = []
    repeat: List[float] = []
    worst = 0.0
    rss = []
    with torch.no_grad(), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for length in range(1, args.lengths + 1):
            rope = rotary(torch.zeros(1, length, d), torch.arange(length)[None])
            xs = [{"hidden_states": torch.randn(2, length, d), "position_embeddings": rope} for _ in models]
            packed = wide.pack(xs)
            for times in (first, repeat):
                started = time.perf_counter()
                out = wide(packed)
                times.append(time.perf_counter() - started)
            for got, model, x in zip(wide.unpack(out), models, xs):
                want = model(**x)
                worst = max(worst, (got - want).abs().max().item())
            if length in (4, args.lengths):
                rss.append(psutil.Process().memory_info().rss / 2**20)
    captures = len(wide.captured._captures) if wide.captured is not None else "torch.fx (one graph)"
    later = slice(2, None)  # after the lengths torch.export specialises (1) and the first dynamic one (2)
    rows = [
        ["captures", str(captures)],
        ["first call at lengths 1, 2 (ms)", ", ".join(f"{t * 1e3:.0f}" for t in first[:2])],
        ["first call at a new length, lengths 3..L, median (ms)", f"{statistics.median(first[later]) * 1e3:.2f}"],
        ["repeat call, lengths 3..L, median (ms)", f"{statistics.median(repeat[later]) * 1e3:.2f}"],
        ["first / repeat, medians", f"{statistics.median(first[later]) / statistics.median(repeat[later]):.2f}x"],
        ["first / repeat, worst length", f"{max(f / r for f, r in zip(first[later], repeat[later])):.2f}x"],
        ["all first calls (s)", f"{sum(first):.2f}"],
        ["RSS after length 4, at the end (MiB)", f"{rss[0]:.0f}, {rss[-1]:.0f}"],
        ["largest difference from the separate calls", f"{worst:.2g}"],
        ["warnings", "; ".join(str(w.message)[:140] for w in said) or "none"],
    ]
    print(f"N={args.n} LlamaDecoderLayer (hidden {d}), lengths 1..{args.lengths}, torch {torch.__version__}")
    print(format_table(["", "measured"], rows))


if __name__ == "__main__":
    main()
