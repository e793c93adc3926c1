"""Every strategy of every built-in op computes what N separate calls compute."""

import random

import pytest
import torch
from torch import nn

from wide_tessera import WideTesseraError
from wide_tessera import benchmark as wt_benchmark
from wide_tessera.core import trees
from wide_tessera.core.capabilities import unmet_need
from wide_tessera.core.correctness import check_outputs, tolerance
from wide_tessera.core.job import DTYPES
from wide_tessera.kernels import triton_unavailable_reason
from wide_tessera.ops import AttentionBlock, WideAttention, WideConv1d, WideConv2d, WideLinear
from wide_tessera.ops.registry import REGISTRY, op_names


def random_params(op: str, rng: random.Random, strategy: str = "") -> dict:
    """Small random shapes for `op`, drawn from axes its bench factories understand."""
    if op == "moe_experts":  # skew 2.5 leaves the last experts of 6 with no tokens at all
        # torch._grouped_mm takes rows of a multiple of 16 bytes only
        width = (lambda: 8 * rng.randint(1, 3)) if strategy == "grouped_mm" else (lambda: rng.randint(1, 20))
        return dict(tokens=rng.randint(1, 9), d_model=width(), hidden=width(), skew=rng.choice([0, 1, 2.5]))
    if op == "hf_experts":  # one family per layout (gpt_oss: transposed, with biases); top_k 1, as N may be 1
        return dict(
            model_type=rng.choice(["mixtral", "qwen2_moe", "olmoe", "gpt_oss"]),
            tokens=rng.randint(1, 9),
            top_k=1,
            hidden=8 * rng.randint(1, 3),
            intermediate=8 * rng.randint(1, 3),
            skew=rng.choice([0, 1, 2.5]),
        )
    if op == "lora":  # torch._grouped_mm takes rows of a multiple of 16 bytes only
        hidden = 8 * rng.randint(1, 3) if strategy == "grouped_mm" else rng.randint(1, 20)
        rank = 8 if strategy == "grouped_mm" else rng.randint(1, 9)
        split = "uniform" if strategy in ("bmm", "peft") else rng.choice(["uniform", "ragged"])
        return dict(hidden=hidden, rank=rank, tokens=rng.randint(1, 9), split=split)
    if op == "mlp":
        return dict(tokens=rng.randint(1, 9), d_model=rng.randint(1, 40), hidden=rng.randint(1, 40))
    if op == "layernorm":
        return dict(batch=rng.randint(1, 9), features=rng.randint(1, 40))
    if op == "gemm":
        return dict(batch=rng.randint(1, 9), in_features=rng.randint(1, 40), out_features=rng.randint(1, 40))
    if op == "embedding":
        return dict(
            batch=rng.randint(1, 5), seq_len=rng.randint(1, 9), vocab=rng.randint(1, 50), dim=rng.randint(1, 20)
        )
    if op in ("gru", "lstm"):  # several sequence lengths, one step included
        return dict(batch=rng.randint(1, 5), seq_len=rng.choice([1, rng.randint(2, 12)]), hidden=rng.randint(1, 12))
    if op in ("batchnorm1d", "instancenorm1d"):  # instance norm needs more than one position
        return dict(batch=rng.randint(2, 5), channels=rng.randint(1, 9), length=rng.randint(2, 20))
    if op in ("batchnorm2d", "instancenorm2d"):
        return dict(batch=rng.randint(2, 5), channels=rng.randint(1, 9), size=rng.randint(2, 6))
    if op == "groupnorm":
        groups = rng.randint(1, 4)
        return dict(batch=rng.randint(1, 5), channels=groups * rng.randint(1, 4), groups=groups, size=rng.randint(1, 6))
    if op in ("conv1d", "conv2d", "conv3d", "conv_transpose2d"):
        size = (
            dict(length=rng.randint(5, 40))
            if op == "conv1d"
            else dict(size=rng.randint(5, 7 if op == "conv3d" else 12))
        )
        return dict(
            batch=rng.randint(1, 4),
            channels=rng.randint(1, 9),
            kernel_size=rng.choice([2, 4] if op == "conv_transpose2d" else [1, 3, 5]),
            **size,
        )
    heads = rng.choice([1, 2, 4])
    return dict(
        batch=rng.randint(1, 3),
        seq_len=rng.randint(1, 33),
        # the Triton flash attention takes head dims 16, 32, 64, 128
        d_model=heads * (16 if strategy == "triton" else rng.randint(2, 9)),
        heads=heads,
        causal=rng.choice([False, True]),
    )


CASES = [
    (op, strategy, dtype, seed)
    for op in op_names()
    for strategy in REGISTRY[op].BENCHMARK_STRATEGIES
    for dtype in DTYPES
    for seed in range(3)
]


@pytest.mark.parametrize("op,strategy,dtype,seed", CASES)
def test_strategy_matches_separate_calls(op, strategy, dtype, seed):
    cls = REGISTRY[op]
    # Triton strategies are CUDA-only in a benchmark, but their kernels run here under the interpreter.
    rng = random.Random(seed)
    params = random_params(op, rng, strategy)
    needs = cls.STRATEGY_NEEDS.get(strategy)
    cuda_only = needs is not None and needs.cuda
    reason = triton_unavailable_reason("cpu") if cuda_only else unmet_need(needs, "cpu", DTYPES[dtype], params)
    if reason is not None:
        pytest.skip(reason)
    n = rng.randint(1, 6)
    torch_dtype = DTYPES[dtype]
    modules = [cls.bench_model(**params).to(torch_dtype).eval() for _ in range(n)]
    inputs = [trees.cast(x, "cpu", torch_dtype) for x in cls.bench_inputs(n, **params)]  # ids stay ids
    with torch.no_grad():
        reference = [trees.call(m, x) for m, x in zip(modules, inputs)]  # a tuple is several inputs
        wide = cls.from_modules(modules, strategy)
        outputs = wide.unpack(trees.call(wide, wide.pack(inputs)))
    check = check_outputs(outputs, reference, tolerance(torch_dtype, "cpu"))
    assert check.correct, (params, n, check)


def test_wide_modules_are_usable_modules():
    """A user can build a wide module directly, move it, and read its parameters."""
    wide = WideLinear(3, 8, 4)
    assert isinstance(wide, nn.Module)
    assert sorted(n for n, _ in wide.named_parameters()) == ["bias", "weight"]
    assert wide.to(torch.float64).weight.dtype == torch.float64
    assert WideConv2d(2, 3, 5, 3, strategy="channels_last").weight.is_contiguous(memory_format=torch.channels_last)


def test_attention_block_is_causal_when_asked():
    block = AttentionBlock(8, 2, causal=True).eval()
    x = torch.randn(1, 5, 8)
    changed = x.clone()
    changed[:, -1] += 1.0  # the last token must not influence earlier positions
    with torch.no_grad():
        assert torch.allclose(block(x)[:, :-1], block(changed)[:, :-1])
        assert not torch.allclose(block(x)[:, -1], block(changed)[:, -1])


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: WideLinear.from_modules([]), "at least one module"),
        (lambda: WideLinear.from_modules([nn.Linear(4, 4), nn.Linear(4, 5)]), "out_features=5"),
        (lambda: WideLinear.from_modules([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)]), "bias=False"),
        (lambda: WideLinear.from_modules([nn.Conv1d(4, 4, 3)]), "Conv1d; expected Linear"),
        (lambda: WideLinear.from_modules([nn.Linear(4, 4)], "fast"), "unknown strategy for gemm 'fast'"),
        (lambda: WideConv1d.from_modules([nn.Conv1d(4, 4, 3, groups=2)]), "groups=1"),
        (lambda: WideConv2d.from_modules([nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 5)]), "kernel_size=\\(5, 5\\)"),
        (lambda: WideAttention.from_modules([AttentionBlock(8, 2), AttentionBlock(8, 2, causal=True)]), "causal=True"),
        (lambda: AttentionBlock(10, 4), "d_model=10 is not divisible by heads=4"),
    ],
)
def test_from_modules_rejects_unlike_modules(make, match):
    with pytest.raises(WideTesseraError, match=match):
        make()


def test_routing_sizes_sum_to_the_tokens_and_skew_empties_experts():
    from wide_tessera.ops.experts import routing_sizes

    assert routing_sizes(4, 128, 0.0) == [32, 32, 32, 32]
    skewed = routing_sizes(64, 64 * 128, 2.0)
    assert sum(skewed) == 64 * 128 and skewed == sorted(skewed, reverse=True)
    assert skewed[0] > 0.5 * 64 * 128 and skewed[-1] < 10


def test_experts_pack_rejects_a_wrong_count_or_width():
    from wide_tessera.ops import Expert, WideExperts

    wide = WideExperts.from_modules([Expert(8, 16) for _ in range(3)], "padded")
    with pytest.raises(WideTesseraError, match="3 token tensors"):
        wide.pack([torch.randn(2, 8)] * 2)
    with pytest.raises(WideTesseraError, match=r"input 1 must be a \[tokens, 8\] tensor"):
        wide.pack([torch.randn(2, 8), torch.randn(2, 9), torch.randn(1, 8)])


@pytest.mark.parametrize("strategy, sizes", [("bmm", [5, 5, 5]), ("grouped_mm", [7, 0, 3]), ("grouped_mm", [4, 4, 4])])
def test_lora_adapters_train_as_n_separate_ones_and_the_base_gets_no_gradient(strategy, sizes):
    """Each adapter its own scaling: the gradients of A and B are the separate adapters', stacked."""
    from wide_tessera.ops.lora import LoRALinear, WideLoRA

    torch.manual_seed(0)
    base = frozen_base()
    modules = [LoRALinear(base, 8, alpha=a) for a in (4.0, 8.0, 16.0)]
    for m in modules:
        nn.init.normal_(m.lora_B.weight)
    inputs = [torch.randn(s, 16) for s in sizes]
    wide = WideLoRA.from_modules(modules, strategy)
    sum(y.square().sum() for y in wide.unpack(wide(wide.pack(inputs)))).backward()
    sum(m(x).square().sum() for m, x in zip(modules, inputs)).backward()
    for name in ("lora_A", "lora_B"):
        separate = torch.stack([getattr(m, name).weight.grad for m in modules])
        torch.testing.assert_close(getattr(wide, name).grad, separate, rtol=1e-4, atol=1e-4)
    assert base.weight.grad is None and base.bias.grad is None


def frozen_base() -> nn.Linear:
    """A base of the lora tests' own (the op's cached one is whatever dtype the last point left it)."""
    return nn.Linear(16, 16).requires_grad_(False)


@pytest.mark.parametrize(
    "third, match",
    [
        (lambda lora, base: nn.Linear(16, 16), "module 2 is a Linear; expected LoRALinear"),
        (lambda lora, base: lora(nn.Linear(16, 16), 8, 8.0), "module 2's base differs"),
        (lambda lora, base: lora(base, 4, 8.0), "module 2 has rank 4 but module 0 rank 8"),
    ],
)
def test_lora_refuses_adapters_that_are_not_over_one_base_at_one_rank(third, match):
    from wide_tessera.ops.lora import LoRALinear, WideLoRA

    base = frozen_base()
    modules = [LoRALinear(base, 8, 8.0) for _ in range(2)]
    with pytest.raises(WideTesseraError, match=match):
        WideLoRA.from_modules([*modules, third(LoRALinear, base)])


def test_lora_trains_in_the_train_mode_its_shared_base_read_back_per_model(fast_timing):
    """The train mode's check compares each model's whole state after training: the base, held once
    (core.layout.SHARED), is every model's. N=3: at N=2 the mode's recipe gives wide_tessera.optim
    two models' betas as a list of two pairs, which it refuses as reading two ways."""
    r = wt_benchmark("lora", preset="ci", device="cpu", n_values=[3], mode="train", split=["uniform"],
                     verbose=False, timing=fast_timing, confirm="none")  # fmt: skip
    assert r.all_correct and {"bmm", "grouped_mm"} <= set(r.points[0].correct), r.points[0].checks


def test_lora_drops_each_adapters_inputs_at_its_own_rate():
    from wide_tessera.ops.lora import LoRALinear, WideLoRA

    torch.manual_seed(0)
    base = frozen_base()
    modules = [LoRALinear(base, 4, 8.0, dropout=p) for p in (0.0, 0.9)]
    inputs = [torch.randn(64, 16) for _ in modules]
    wide = WideLoRA.from_modules([m.eval() for m in modules])
    with torch.no_grad():
        kept = wide.unpack(wide(wide.pack(inputs)))
        dropped = wide.unpack(wide.train()(wide.pack(inputs)))
    assert torch.equal(kept[0], dropped[0]) and not torch.allclose(kept[1], dropped[1])


@pytest.mark.parametrize(
    "installed, split, reason",
    [
        (False, "uniform", "needs peft (pip install peft)"),
        (True, "ragged", "needs as many tokens for every adapter"),
        (True, "uniform", None),
    ],
)
def test_lora_peft_strategy_is_skipped_with_the_reason_where_it_cannot_run(monkeypatch, installed, split, reason):
    import importlib.util

    from wide_tessera.ops.lora import WideLoRA

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: real(name) if installed or name != "peft" else None)
    said = unmet_need(WideLoRA.STRATEGY_NEEDS["peft"], "cpu", torch.float32, dict(split=split))
    assert said == reason if reason is None else said.startswith(reason)
