"""A PeftModel's N LoRA adapters trained as one model end as N separate PEFT trainings."""

import copy

import pytest
import torch
import torch.nn.functional as F

import wide_tessera.optim as wide_optim
from wide_tessera import WideTesseraError

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

NAMES = ("sql", "chat", "code")
LRS = (1e-2, 3e-3, 1e-3)
STEPS = 4


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def with_adapters(base, alphas=(8, 16, 4), ranks=(4, 4, 4), targets=("q_proj", "v_proj")):
    """get_peft_model over `base` with one adapter per name; B random, so every layer's adapter counts."""
    def config(alpha, rank):
        return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)

    model = peft.get_peft_model(base, config(alphas[0], ranks[0]), adapter_name=NAMES[0])
    for name, alpha, rank in zip(NAMES[1:], alphas[1:], ranks[1:]):
        model.add_adapter(name, config(alpha, rank))
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (len(NAMES), 2, 12), generator=g)


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train_separately(model, ids):
    """Each adapter trained alone, as PEFT trains it: its own copy, set_adapter, torch's AdamW."""
    trained = {}
    for i, name in enumerate(NAMES):
        alone = copy.deepcopy(model)
        alone.set_adapter(name)
        params = [p for p in alone.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=LRS[i])
        for _ in range(STEPS):
            optimizer.zero_grad()
            lm_loss(alone(input_ids=ids[i]).logits, ids[i]).backward()
            optimizer.step()
        trained[name] = {k: v.detach().clone() for k, v in alone.named_parameters() if f".{name}." in k}
    return trained


def test_n_adapters_trained_fused_are_n_separate_peft_trainings_and_load_back_in_peft(tmp_path):
    from wide_tessera.integrations.peft import fuse_adapters

    model = with_adapters(tiny_llama())
    base_before = {k: v.clone() for k, v in model.named_parameters() if "lora_" not in k}
    ids = batches()
    separate = train_separately(model, ids)

    fused = fuse_adapters(model)
    assert fused.n == 3 and fused.adapters == list(NAMES)
    optimizer = wide_optim.AdamW(fused, lr=list(LRS))
    for _ in range(STEPS):
        optimizer.zero_grad()
        logits = fused(input_ids=ids).logits
        assert logits.shape == (3, 2, 12, 64)
        sum(lm_loss(logits[i], ids[i]) for i in range(3)).backward()
        optimizer.step()
    assert all(p.grad is None for k, p in fused.named_parameters() if "lora_" not in k)  # the base gets none

    fused.unfuse(into=model)
    for name in NAMES:
        for key, value in separate[name].items():
            torch.testing.assert_close(dict(model.named_parameters())[key], value, rtol=1e-4, atol=1e-5)
    for key, value in base_before.items():
        assert torch.equal(dict(model.named_parameters())[key], value), key

    # each adapter saved by PEFT loads in PEFT over a fresh base and gives the fused logits
    model.save_pretrained(tmp_path, selected_adapters=list(NAMES))
    fused.eval()
    with torch.no_grad():
        wide_logits = fused(input_ids=ids).logits
    for i, name in enumerate(NAMES):
        # PEFT saves an adapter not named "default" in a folder of its name
        loaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / name, adapter_name=name).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids[i]).logits, wide_logits[i], rtol=1e-4, atol=1e-5)


def test_the_fused_model_shares_the_base_and_leaves_the_peft_model_as_it_was():
    from wide_tessera.integrations.peft import fuse_adapters

    model = with_adapters(tiny_llama())
    fused = fuse_adapters(model)
    shared = {id(p) for p in model.parameters()}
    assert all(id(p) in shared for k, p in fused.named_parameters() if "lora_" not in k)
    assert fused.model.get_submodule("model.layers.0.self_attn.q_proj").scaling.tolist() == [2.0, 4.0, 1.0]
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj).__module__.startswith("peft")


def other_layers(model):
    model.add_adapter("docs", peft.LoraConfig(r=4, target_modules=["k_proj"]))
    return model


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: with_adapters(tiny_llama(), ranks=(4, 8, 4)), "adapter 'chat' has r=8 but 'sql' r=4"),
        (lambda: other_layers(with_adapters(tiny_llama())), "adapter 'docs' has target_modules="),
    ],
)
def test_adapters_that_cannot_run_as_one_are_refused_in_one_line(build, match):
    from wide_tessera.integrations.peft import fuse_adapters

    with pytest.raises(WideTesseraError, match=match):
        fuse_adapters(build())


def with_lora_bias(model):
    model.add_adapter("biased", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_bias=True))
    return model


@pytest.mark.parametrize(
    "build, names, match",
    [
        # lora_B's own bias was dropped without a word: logits 0.19 and 0.37 off PEFT's
        (lambda: with_lora_bias(with_adapters(tiny_llama())), None, "adapter 'biased' has lora_bias=True"),
        # one adapter twice: unfuse() wrote both copies into it, the last one winning
        (lambda: with_adapters(tiny_llama()), [NAMES[0], NAMES[0]], f"adapter '{NAMES[0]}' is named twice"),
    ],
)
def test_what_the_wide_layer_would_not_compute_is_refused_in_one_line(build, names, match):
    from wide_tessera.integrations.peft import fuse_adapters

    with pytest.raises(WideTesseraError, match=match):
        fuse_adapters(build(), names)


@pytest.mark.parametrize("given, match", [(torch.nn.Linear(2, 2), "give a peft PeftModel"), ("x", "PeftModel")])
def test_what_is_not_a_peft_model_is_refused(given, match):
    from wide_tessera.integrations.peft import fuse_adapters

    with pytest.raises(WideTesseraError, match=match):
        fuse_adapters(given)
