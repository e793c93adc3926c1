"""Issue 66's training targets in one run: N=8 LoRA adapters of a tiny Llama trained fused
against 8 separate PEFT trainings, and what each costs.

    python scripts/lora_training.py [--steps 20] [--rounds 5]

A Llama built in code (4 layers, hidden 256, vocabulary 256; nothing is downloaded) gets 8 LoRA
adapters of rank 8 on q_proj and v_proj, each its own alpha and learning rate. From the same
start they train `--steps` AdamW steps two ways: fused (`fuse_adapters`, one
`wide_tessera.optim.AdamW` with a learning rate per adapter, each adapter on its own batch) and
as 8 separate PEFT trainings (`set_adapter`, torch's AdamW). The table says:

* each adapter's largest weight difference between the two, and the project's verdict on the
  trained weights (core.correctness.check_trained with ADAM_TRAINED, the train mode's tolerance);
* whether the base is bitwise what it was;
* the largest difference between the fused model's logits and those of each adapter given back
  by `unfuse()`, saved by PEFT's `save_pretrained` and loaded by `PeftModel.from_pretrained`;
* peak memory: the kernel's high-water mark of the process's resident memory (VmHWM, reset
  through /proc/self/clear_refs), above what it held before the model was built, for the fused
  training and for one adapter's training, each in a process of its own forked before either
  ran. Not tracemalloc: it sees Python's allocator only, and torch allocates tensors on the CPU
  with its own. Not a poll of the RSS (psutil): a peak between two polls is missed. 8 separate
  models, as 8 jobs over their own copy of the base hold them, are 8 times one adapter's
  training (computed, not run); at two batch sizes;
* a training step's time fused against the 8 separate steps at those two batch sizes, the
  median of `--rounds` interleaved rounds, and the dispatch table's answer for the `lora` op at that
  number of tokens per adapter (no table entry: `wide_tessera tune lora` writes them).

One thread (torch.set_num_threads(1)): on a machine others use, a second thread measures them.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import statistics
import tempfile
import time
import warnings
from functools import partial
from typing import Callable, Dict, List, Sequence, Tuple

import peft
import torch
import torch.nn.functional as F
import transformers

import wide_tessera as wt
import wide_tessera.optim as wto
from wide_tessera.core.correctness import ADAM_TRAINED, check_trained
from wide_tessera.integrations.peft import fuse_adapters
from wide_tessera.ops.lora import LoRALinear

N, VOCAB, HIDDEN, RANK = 8, 256, 256, 8
NAMES = [f"task{i}" for i in range(N)]
LRS = [2e-3 * 0.7**i for i in range(N)]
TRAIN_SIZE = (2, 32)  # (batch, sequence) of each adapter in the trained comparison
SIZES = [(1, 8), (2, 32)]  # those of the memory and the step times


def base_model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def adapted(n: int) -> peft.PeftModel:
    """The base with `n` adapters, each its own alpha; B random, so that every adapter counts from step 0."""

    def config(i: int) -> peft.LoraConfig:
        targets = ["q_proj", "v_proj"]
        return peft.LoraConfig(r=RANK, lora_alpha=4 * (i + 1), target_modules=targets, init_lora_weights=False)

    model = peft.get_peft_model(base_model(), config(0), adapter_name=NAMES[0])
    for i in range(1, n):
        model.add_adapter(NAMES[i], config(i))
    return model


def batches(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (N, batch, seq), generator=torch.Generator().manual_seed(1))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def alone(model: peft.PeftModel, i: int) -> Tuple[peft.PeftModel, torch.optim.Optimizer]:
    """Adapter i's separate training, as PEFT trains one adapter: a copy of the model, set_adapter, torch's AdamW."""
    copied = copy.deepcopy(model)
    copied.set_adapter(NAMES[i])
    return copied, torch.optim.AdamW([p for p in copied.parameters() if p.requires_grad], lr=LRS[i])


def separate_step(model: peft.PeftModel, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    optimizer.zero_grad()
    lm_loss(model(input_ids=ids).logits, ids).backward()
    optimizer.step()


def fused_step(fused: torch.nn.Module, optimizer: wto.AdamW, ids: torch.Tensor) -> None:
    optimizer.zero_grad()
    logits = fused(input_ids=ids).logits  # [N, batch, seq, vocab]
    sum(lm_loss(logits[i], ids[i]) for i in range(N)).backward()  # each adapter its own loss
    optimizer.step()


def own(model: torch.nn.Module, name: str) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if f".{name}." in k}


def trained(steps: int) -> List[Tuple[str, str]]:
    """The trained comparison's rows."""
    model = adapted(N)
    start = {name: own(model, name) for name in NAMES}
    base = {k: v.clone() for k, v in model.named_parameters() if "lora_" not in k}
    ids = batches(*TRAIN_SIZE)
    want = []
    for i in range(N):
        copied, optimizer = alone(model, i)
        for _ in range(steps):
            separate_step(copied, optimizer, ids[i])
        want.append(own(copied, NAMES[i]))
    fused = fuse_adapters(model)
    optimizer = wto.AdamW(fused, lr=LRS)
    for _ in range(steps):
        fused_step(fused, optimizer, ids)
    fused.unfuse(into=model)
    got = [own(model, name) for name in NAMES]
    apart = [max((got[i][k] - w).abs().max().item() for k, w in want[i].items()) for i in range(N)]
    moved = [max((w - start[NAMES[i]][k]).abs().max().item() for k, w in want[i].items()) for i in range(N)]
    verdict = check_trained(got, want, ADAM_TRAINED)
    untouched = all(torch.equal(v, base[k]) for k, v in model.named_parameters() if "lora_" not in k)
    rows = [
        ("adapter weights, fused vs separate (max abs, worst adapter)", f"{max(apart):.2e}"),
        ("  each adapter", " ".join(f"{a:.1e}" for a in apart)),
        ("  how far training moved them (max abs)", f"{min(moved):.1e} to {max(moved):.1e}"),
        ("  check_trained, ADAM_TRAINED", "correct" if verdict.correct else f"WRONG: {verdict.error}"),
        ("base bitwise untouched", "yes" if untouched else "NO"),
    ]
    return rows + [("unfuse()d, saved and loaded by PEFT: logits (max abs)", f"{loaded_logits(fused, model, ids):.2e}")]


def loaded_logits(fused: torch.nn.Module, model: peft.PeftModel, ids: torch.Tensor) -> float:
    fused.eval()
    worst = 0.0
    with torch.no_grad(), tempfile.TemporaryDirectory() as where:
        wide = fused(input_ids=ids).logits
        model.save_pretrained(where, selected_adapters=NAMES)
        for i, name in enumerate(NAMES):  # PEFT saves an adapter not named "default" in a folder of its name
            loaded = peft.PeftModel.from_pretrained(base_model(), f"{where}/{name}", adapter_name=name).eval()
            worst = max(worst, (loaded(input_ids=ids[i]).logits - wide[i]).abs().max().item())
    return worst


def _peak(train: Callable[[], None], conn: multiprocessing.connection.Connection) -> None:
    def status(key: str) -> int:
        line = next(s for s in open("/proc/self/status") if s.startswith(key))
        return int(line.split()[1]) * 1024

    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from here
    train()
    conn.send(status("VmHWM:") - before)


def peak_bytes(train: Callable[[], None]) -> int:
    """The peak resident memory `train` adds, run in a process forked from this one."""
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    child = context.Process(target=_peak, args=(train, theirs))
    child.start()
    peak = ours.recv()
    child.join()
    return int(peak)


def train_one(batch: int, seq: int) -> None:
    model = adapted(1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LRS[0])
    ids = batches(batch, seq)[0]
    for _ in range(3):
        separate_step(model, optimizer, ids)


def train_fused(batch: int, seq: int) -> None:
    fused = fuse_adapters(adapted(N))
    optimizer = wto.AdamW(fused, lr=LRS)
    ids = batches(batch, seq)
    for _ in range(3):
        fused_step(fused, optimizer, ids)


def peaks() -> List[Tuple[int, int]]:
    """(fused, one adapter's) peak memory at each size, each training forked before anything else ran."""
    return [(peak_bytes(partial(train_fused, *size)), peak_bytes(partial(train_one, *size))) for size in SIZES]


def memory_rows(measured: List[Tuple[int, int]]) -> List[Tuple[str, str]]:
    base = sum(p.numel() * p.element_size() for p in base_model().parameters())
    mb = 2**20
    rows = [("base's parameters", f"{base / mb:.1f} MB")]
    for (batch, seq), (fused, one) in zip(SIZES, measured):
        rows.append(
            (
                f"peak memory, batch {batch} x seq {seq}: fused | one adapter | {N} separate models",
                f"{fused / mb:.1f} MB | {one / mb:.1f} MB | {N * one / mb:.1f} MB (computed): fused "
                f"{fused / one:.2f}x one adapter's",
            )
        )
    return rows


def timed_rows(rounds: int) -> List[Tuple[str, str]]:
    model = adapted(N)
    rows = []
    for batch, seq in SIZES:
        ids = batches(batch, seq)
        separate = [alone(model, i) for i in range(N)]
        fused = fuse_adapters(model)
        optimizer = wto.AdamW(fused, lr=LRS)
        fused_s, separate_s = [], []
        for r in range(rounds + 1):  # interleaved; the first round warms up
            started = time.perf_counter()
            fused_step(fused, optimizer, ids)
            middle = time.perf_counter()
            for i, (copied, opt) in enumerate(separate):
                separate_step(copied, opt, ids[i])
            if r:
                fused_s.append(middle - started)
                separate_s.append(time.perf_counter() - middle)
        f, s = statistics.median(fused_s), statistics.median(separate_s)
        rows.append(
            (
                f"step, batch {batch} x seq {seq} per adapter: fused | {N} separate",
                f"{1e3 * f:.1f} ms | {1e3 * s:.1f} ms = {s / f:.2f}x; table: {table_answer(batch * seq)}",
            )
        )
    return rows


def table_answer(tokens: int) -> str:
    """What fuse() of N LoRA layers of the model's size decides at `tokens` per adapter, and why."""
    base = torch.nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untuned warning says what the reason says
        models = [LoRALinear(base, RANK, 2 * RANK) for _ in range(N)]
        decision = wt.fuse(models, op="lora", mode="train_step", tokens=tokens, split="uniform").decision
    return decision.match.reason


def table(rows: Sequence[Tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, once per adapter loaded
    started = time.perf_counter()
    measured = peaks()
    rows = [(f"{N} adapters, {args.steps} AdamW steps at batch {TRAIN_SIZE}, lr {LRS[0]:.1e} to {LRS[-1]:.1e}", "")]
    rows += trained(args.steps) + memory_rows(measured) + timed_rows(args.rounds)
    table(rows)
    print(f"({time.perf_counter() - started:.0f} s, one thread)")


if __name__ == "__main__":
    main()
