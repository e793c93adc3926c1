"""How long a first call takes against its time bound: fuse(measure='first-call') promises that
the whole of it (the separate calls, building and checking each strategy, timing) stays within
twice `time_bound_s`, beyond the call itself (a bound shorter than one call of the loop cannot cover
the call: the table shows the loop's call, taken warm after the first, so the time the first call
added is if anything overstated). Each case runs in a fresh process, as a user's first call does, and the
table prints the first call's seconds, its ratio to the bound, and what it decided.

    python scripts/first_call_bound.py                 # Linear(4, 4) x 16 .. 10,000; bounds 0.05, 0.5, 2
    python scripts/first_call_bound.py --model llama   # N=8 tiny Llama decoder layers (transformers)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click


def _models(model: str, n: int):
    import torch

    torch.manual_seed(0)
    if model == "linear":
        return [torch.nn.Linear(4, 4) for _ in range(n)], [torch.randn(2, 4) for _ in range(n)]
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1
    )

    class Layer(torch.nn.Module):  # a decoder layer with its rotary embedding: one input, one output
        def __init__(self):
            super().__init__()
            self.layer, self.rotary = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)

        def forward(self, x):
            positions = torch.arange(x.shape[1]).unsqueeze(0)
            return self.layer(x, position_embeddings=self.rotary(x, positions))

    return [Layer().eval() for _ in range(n)], [torch.randn(2, 16, 64) for _ in range(n)]


def _one(model: str, n: int, bound: float) -> dict:
    import wide_tessera as wt
    from wide_tessera.core import trees

    modules, inputs = _models(model, n)
    with tempfile.TemporaryDirectory() as folder:
        fused = wt.fuse(modules, measure="first-call", time_bound_s=bound, table=str(Path(folder) / "t.json"))
        packed = fused.pack(inputs)
        started = time.perf_counter()
        fused(packed)
        seconds = time.perf_counter() - started
    started = time.perf_counter()  # the call itself, as the loop: what a first call without fuse() costs
    trees.call_each(modules, inputs)
    loop_s = time.perf_counter() - started
    because = str(fused.decision).splitlines()[1].strip()
    return {"seconds": seconds, "loop_s": loop_s, "decided": fused.decision.strategy or "loop", "because": because}


@click.command()
@click.option("--model", type=click.Choice(["linear", "llama"]), default="linear", show_default=True)
@click.option("--n", "ns", type=int, multiple=True, help="N values (default: 16 100 1000 10000; llama: 8)")
@click.option("--bound", "bounds", type=float, multiple=True, help="time bounds, s (default: 0.05 0.5 2)")
@click.option("--one", is_flag=True, hidden=True)
def main(model: str, ns: tuple, bounds: tuple, one: bool) -> None:
    if one:
        print(json.dumps(_one(model, ns[0], bounds[0])))
        return
    ns = ns or ((8,) if model == "llama" else (16, 100, 1000, 10000))
    bounds = bounds or (0.05, 0.5, 2.0)
    print(f"| {model} N | time_bound_s | first call (s) | a loop call (s) | added, of the bound | decided | because |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for n in ns:
        for bound in bounds:
            command = [sys.executable, __file__, "--one", "--model", model, "--n", str(n), "--bound", str(bound)]
            printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            row = json.loads(printed.splitlines()[-1])
            added = (row["seconds"] - row["loop_s"]) / bound
            worst = max(worst, added)
            print(
                f"| {n} | {bound:g} | {row['seconds']:.2f} | {row['loop_s']:.2f} | {added:.1f}x | {row['decided']} "
                f"| {row['because'][:110]} |"
            )
    print(f"\nworst: the first call added {worst:.1f}x its bound to the call (the promise: at most 2x)")


if __name__ == "__main__":
    main()
