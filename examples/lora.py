"""N LoRA adapters of one tiny Llama trained as one model, the base read once for the N batches,
then each adapter saved by PEFT and loaded back by PEFT.

    python examples/lora.py [--adapters 4] [--steps 20]

Builds a Llama (4 layers, hidden 256) from a config in code (nothing is downloaded), gives it N
LoRA adapters of rank 8 on q_proj and v_proj with different alphas, and trains them two ways
from the same start: fused (`wide_tessera.integrations.peft.fuse_adapters`, one
`wide_tessera.optim.AdamW` with a learning rate per adapter) and as N separate PEFT trainings
(`set_adapter`, torch's AdamW). It prints each adapter's largest difference between the two,
the time of a training step each way, and the logits of each adapter saved and loaded by PEFT
against the fused model's.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import peft
import torch
import torch.nn.functional as F
import transformers

import wide_tessera.optim as wto
from wide_tessera.integrations.peft import fuse_adapters

VOCAB, SEQ, BATCH = 512, 64, 4


def base_model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    n = args.adapters
    names = [f"task{i}" for i in range(n)]
    lrs = [1e-3 * 0.5**i for i in range(n)]

    def config(i: int) -> peft.LoraConfig:
        targets = ["q_proj", "v_proj"]
        return peft.LoraConfig(r=8, lora_alpha=8 * (i + 1), target_modules=targets, init_lora_weights=False)

    model = peft.get_peft_model(base_model(), config(0), adapter_name=names[0])
    for i, name in enumerate(names[1:], start=1):
        model.add_adapter(name, config(i))
    ids = torch.randint(0, VOCAB, (n, BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    separate, seconds = {}, 0.0
    for i, name in enumerate(names):  # N separate PEFT trainings, each on a copy of the model
        alone = copy.deepcopy(model)
        alone.set_adapter(name)
        optimizer = torch.optim.AdamW([p for p in alone.parameters() if p.requires_grad], lr=lrs[i])
        for _ in range(args.steps):
            started = time.perf_counter()
            optimizer.zero_grad()
            lm_loss(alone(input_ids=ids[i]).logits, ids[i]).backward()
            optimizer.step()
            seconds += time.perf_counter() - started
        separate[name] = {k: v.detach() for k, v in alone.named_parameters() if f".{name}." in k}
    print(f"N separate PEFT trainings: {1e3 * seconds / args.steps:.1f} ms per step of all {n} adapters")

    fused = fuse_adapters(model)
    optimizer = wto.AdamW(fused, lr=lrs)
    started = time.perf_counter()
    for _ in range(args.steps):
        optimizer.zero_grad()
        logits = fused(input_ids=ids).logits  # [N, batch, seq, vocab]
        sum(lm_loss(logits[i], ids[i]) for i in range(n)).backward()
        optimizer.step()
    print(f"fused: {1e3 * (time.perf_counter() - started) / args.steps:.1f} ms per step (one process, not interleaved)")

    fused.unfuse(into=model)
    weights = dict(model.named_parameters())
    for name in names:
        worst = max((weights[k] - v).abs().max().item() for k, v in separate[name].items())
        print(f"{name}: largest difference from its separate training {worst:.2e}")

    fused.eval()
    with torch.no_grad(), tempfile.TemporaryDirectory() as where:
        wide_logits = fused(input_ids=ids).logits
        model.save_pretrained(where, selected_adapters=names)
        for i, name in enumerate(names):  # PEFT saves an adapter not named "default" in a folder of its name
            loaded = peft.PeftModel.from_pretrained(base_model(), f"{where}/{name}", adapter_name=name).eval()
            worst = (loaded(input_ids=ids[i]).logits - wide_logits[i]).abs().max().item()
            print(f"{name} saved and loaded by PEFT: logits at most {worst:.2e} from the fused model's")


if __name__ == "__main__":
    main()
