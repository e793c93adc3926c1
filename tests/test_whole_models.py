"""Whole transformers language models through benchmark_custom and fuse(), in inference and in
training: outputs holding a DynamicCache are compared by their tensors, tied weights stay tied."""

import copy
import warnings

import pytest
import torch

import wide_tessera as wt
import wide_tessera.optim as wto
from wide_tessera.core import trees
from wide_tessera.core.correctness import ADAM_TRAINED, check_trained

transformers = pytest.importorskip("transformers")

VOCAB = 64


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def gpt2_without_cache():
    """GPT-2 returning no DynamicCache, which torch.export cannot give: surgery's capture."""
    model = gpt2()
    model.config.use_cache = False
    return model


def bert():
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def llama():
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def without_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def test_a_dynamic_cache_is_opened_into_its_tensors_and_rebuilt():
    torch.manual_seed(0)
    out = gpt2().eval()(torch.randint(0, VOCAB, (2, 5)))
    leaves, structure = trees.flat(out)
    assert sum(isinstance(t, torch.Tensor) for t in leaves) == 5  # the logits, and 2 layers' keys and values
    again = trees.unflat(leaves, structure)
    assert type(again.past_key_values) is type(out.past_key_values)
    assert torch.equal(again.past_key_values.layers[1].values, out.past_key_values.layers[1].values)


@pytest.mark.parametrize(
    "make,strategy", [(gpt2, "vmap"), (gpt2_without_cache, "surgery"), (bert, "surgery"), (llama, "vmap")]
)
def test_a_language_model_fuses_whole_and_its_outputs_equal_the_separate_calls(make, strategy):
    torch.manual_seed(0)
    models = [make().eval() for _ in range(3)]
    fused = wt.fuse(models, strategy=strategy)
    xs = [torch.randint(0, VOCAB, (2, 6)) for _ in range(3)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's fallback for attention on the CPU
        got = fused.unpack(fused(fused.pack(xs)))
        want = [m(x) for m, x in zip(models, xs)]
    for g, w in zip(got, want):
        assert trees.flat(g)[1] == trees.flat(w)[1]
        torch.testing.assert_close(trees.tensors(g), trees.tensors(w), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make,strategy", [(gpt2, "vmap"), (gpt2_without_cache, "surgery"), (bert, "surgery"), (llama, "vmap")]
)
def test_a_language_model_trains_fused_as_n_separate_trainings(make, strategy):
    torch.manual_seed(0)
    models = [without_dropout(make()) for _ in range(3)]
    xs = [torch.randint(0, VOCAB, (2, 6)) for _ in range(3)]
    lrs = [1e-3, 3e-4, 3e-3]
    separate = copy.deepcopy(models)
    for m, x, lr in zip(separate, xs, lrs):
        opt = torch.optim.AdamW(m.parameters(), lr=lr)
        for _ in range(5):
            trees.tensors(m(x))[0].pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    fused = wt.fuse(copy.deepcopy(models), strategy=strategy)
    opt = wto.AdamW(fused, lr=lrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            sum(trees.tensors(o)[0].pow(2).mean() for o in fused.unpack(fused(fused.pack(xs)))).backward()
            opt.step()
            opt.zero_grad()
    got = [dict(m.named_parameters()) for m in fused.unfuse()]
    check = check_trained(got, [dict(m.named_parameters()) for m in separate], ADAM_TRAINED)
    assert check.correct, check.error


@pytest.mark.slow
def test_gpt2_in_benchmark_custom_has_a_correct_fused_strategy_in_inference_and_training():
    for mode in ("inference", "train"):
        result = wt.benchmark_custom(
            gpt2, (2, 8), [3], input_dtype="int64", int_high=VOCAB, mode=mode, verbose=False, confirm="none",
            controls=False, randomness="error" if mode == "inference" else "different",
            timing=wt.TimingConfig(budget_s=0.05, min_samples=3),
        )  # fmt: skip
        (point,) = result.points
        assert point.checks["vmap"].correct, (mode, point.checks["vmap"].error)


def test_surgery_of_an_moe_model_that_records_its_routers_logits_says_why_it_cannot():
    """Surgery swaps each sparse MoE block whole, and a model that records its routers' logits
    (for its load-balancing loss) found none: torch.export's 'tuple index out of range'."""
    from wide_tessera.core.errors import NotApplicable

    config = transformers.MixtralConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=VOCAB, num_local_experts=4, output_router_logits=True,
    )  # fmt: skip
    models = [transformers.MixtralForCausalLM(config) for _ in range(2)]
    with pytest.raises(NotApplicable, match=r"records its router's logits \(output_router_logits=True\)"):
        wt.fuse(models, strategy="surgery")


def test_surgery_of_a_model_returning_a_cache_says_what_torch_export_cannot_give():
    """torch.export's own line named the cache's class only, cut short: surgery of whole GPT-2 read as a crash."""
    fused = wt.fuse([gpt2() for _ in range(2)], strategy="surgery")
    with pytest.raises(wt.WideTesseraError, match="holds a DynamicCache.*use_cache=False"):
        fused(fused.pack([torch.randint(0, VOCAB, (2, 6)) for _ in range(2)]))
