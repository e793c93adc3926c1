"""Layers of transformers models, as they are: built from tiny configs in code (no download),
called with their own keyword inputs, RoPE tables and optional arguments left at None, measured
by benchmark_custom and fused by fuse(), in inference and train_step."""

import operator
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

from wide_tessera import DispatchTable, benchmark_custom, fuse
from wide_tessera.core import trees
from wide_tessera.core.layout import slots_of
from wide_tessera.widen.custom import custom_wide, model_identity
from wide_tessera.widen.moe import WideSparseMoe, is_sparse_moe
from wide_tessera.widen.surgery import WideSurgery

from .test_dispatch import entry

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from real_modules import D, catalogue, held_out, initialised, moe_families  # noqa: E402  the catalogue scripts/real_modules.py measures at N=16

LAYERS = catalogue()
MOE = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock")
STRATEGIES = [(n, "vmap") for n in LAYERS if n not in MOE] + [(n, "surgery") for n in LAYERS]


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a standalone layer's note on its attention implementation
        yield


@pytest.mark.parametrize("mode", ["inference", "train_step"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_benchmark_custom_measures_a_transformers_layer_as_it_is(name, mode, fast_timing):
    cls, kwargs, inputs = LAYERS[name]
    r = benchmark_custom(
        cls, None, [2], model_kwargs=kwargs, input_factory=inputs, mode=mode, device="cpu", verbose=False,
        timing=fast_timing, confirm="none", controls=mode == "train_step",
        randomness="different" if mode == "train_step" else "error",  # dropout in train mode
    )  # fmt: skip
    point = r.points[0]
    if name in MOE:  # vmap cannot run the experts' loop; surgery makes the N blocks one of N·E experts
        assert point.correct["surgery"] and point.failures["vmap"].kind == "skipped", r.summary()
        assert "aten::nonzero" in point.failures["vmap"].message
        return
    # surgery runs on every layer: traced by torch.fx where it can, else captured by torch.export
    assert r.op == name and point.correct == {"vmap": True, "surgery": True, **controls(point)}, r.summary()


def controls(point):
    return {k: v for k, v in point.correct.items() if k.startswith("loop_")}


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("name,strategy", STRATEGIES)
def test_fuse_gives_the_separate_calls_outputs_and_gradients(name, strategy, train):
    cls, kwargs, inputs = LAYERS[name]
    torch.manual_seed(0)
    models = [cls(**kwargs).train(train) for _ in range(3)]
    for m in models:
        for p in m.modules():  # the same dropout draws cannot be asked of two sides: train without it
            if isinstance(p, torch.nn.Dropout):
                p.p = 0.0
    key = {k: v for k, v in model_identity(models[0]).items() if k != "class"}
    table = DispatchTable([entry(op=name, params=key, strategy=strategy, verdicts="fuse:2 fuse:4")])
    fused = fuse(models, table=table).train(train)
    assert fused.decision.strategy == strategy
    xs = [inputs() for _ in range(3)]
    got = fused.unpack(fused(fused.pack(xs)))
    want = [trees.call(m, x) for m, x in zip(models, xs)]
    for g, w in zip(got, want):
        torch.testing.assert_close(trees.tensors(g), trees.tensors(w), rtol=1e-4, atol=1e-5)
    sum(trees.tensors(g)[0].sum() for g in got).backward()
    sum(trees.tensors(w)[0].sum() for w in want).backward()
    assert_gradients_are_the_models(fused, models)


def assert_gradients_are_the_models(fused, models):
    """Each model's part of every wide parameter's gradient (where its layout says) is that model's own."""
    params = dict(fused.named_parameters())
    checked = 0
    for key, slot in slots_of(fused).items():
        if key not in params:
            continue
        own = [operator.attrgetter(slot.name)(m).grad for m in models]
        for i, part in enumerate(slot.layout.parts(params[key].grad, len(models))):
            want = own[i] if own[i] is not None else torch.zeros_like(part)
            torch.testing.assert_close(part, want, rtol=1e-4, atol=1e-5, msg=f"{key} ({slot.name}) of model {i}")
            checked += 1
    assert checked >= len(models)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("name", list(held_out()))
def test_surgery_of_layers_the_catalogue_does_not_name_gives_the_separate_calls_results(name, train):
    cls, kwargs, inputs = held_out()[name]
    torch.manual_seed(0)
    models = [without_dropout(initialised(cls, **kwargs).train(train)) for _ in range(3)]
    wide = WideSurgery(models)
    assert wide.swapped, "its linears (and norms) are swapped for wide ones"
    assert_like_the_separate_calls(wide, models, inputs, train)
    assert wide.captured.vmapped == {}, "every stretch between swapped layers runs at once (lowering.py)"


def assert_like_the_separate_calls(wide, models, inputs, train):
    """`wide`'s outputs on three draws of `inputs()` are the models', and in training so are its gradients."""
    xs = [inputs() for _ in range(3)]
    got = wide.unpack(wide(wide.pack(xs)))
    want = [trees.call(m, x) for m, x in zip(models, xs)]
    for g, w in zip(got, want):
        torch.testing.assert_close(trees.tensors(g), trees.tensors(w), rtol=1e-4, atol=1e-5)
    if train:
        sum(trees.tensors(g)[0].sum() for g in got).backward()
        sum(trees.tensors(w)[0].sum() for w in want).backward()
        assert_gradients_are_the_models(wide, models)


def without_dropout(model):
    """`model` drawing no dropout: an nn.Dropout's p, and the rates layers keep as floats (Bart's `dropout`,
    attention's `attention_dropout`), set to 0, so one wide call and N separate ones compute the same."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for k, v in vars(m).items():
            if isinstance(v, float) and ("dropout" in k or "pdrop" in k):
                setattr(m, k, 0.0)
    return model


def test_a_decoder_layer_with_a_sparse_moe_block_inside_is_fused_by_surgery(fast_timing):
    """vmap cannot run the experts' loop inside; surgery captures the layer with torch.export and makes
    its N MoE blocks one block of N·E experts."""
    cls, kwargs, inputs = held_out()["MixtralDecoderLayer"]
    r = benchmark_custom(cls, None, [2], model_kwargs=kwargs, input_factory=inputs, device="cpu", verbose=False,
                         timing=fast_timing, confirm="none")  # fmt: skip
    point = r.points[0]
    assert point.correct == {"surgery": True}, r.summary()
    why = point.failures["vmap"]
    assert why.kind == "skipped" and "MixtralDecoderLayer.mlp's experts loop" in why.message


def vmap_cannot():
    """Layers with what torch's vmap cannot run: BloomBlock's GeLU is an autograd.Function of the
    old style (no setup_context), DbrxFFN's experts loop over those a batch hit (aten::nonzero)."""
    import transformers as T
    from transformers.models.bloom.modeling_bloom import BloomBlock, build_alibi_tensor
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN

    alibi = build_alibi_tensor(torch.ones(2, 6), 4, torch.float32)  # one table for all N models
    dbrx = T.DbrxConfig(d_model=D, n_heads=4, ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2})
    return {
        "BloomBlock": (BloomBlock, {"config": T.BloomConfig(hidden_size=D, n_head=4)},
                       lambda: {"hidden_states": torch.randn(2, 6, D), "alibi": alibi, "attention_mask": None}),
        "DbrxFFN": (partial(initialised, DbrxFFN), {"config": dbrx}, lambda: torch.randn(2, 6, D)),
    }  # fmt: skip


@pytest.mark.parametrize("name,why", [("BloomBlock", "setup_context"), ("DbrxFFN", "aten::nonzero")])
def test_what_vmap_cannot_run_in_a_real_layer_is_skipped_with_torchs_reason(name, why, fast_timing):
    cls, kwargs, inputs = vmap_cannot()[name]
    r = benchmark_custom(cls, None, [2], model_kwargs=kwargs, input_factory=inputs, device="cpu", verbose=False,
                         timing=fast_timing, confirm="none")  # fmt: skip
    point = r.points[0]
    assert point.failures["vmap"].kind == "skipped" and why in point.failures["vmap"].message, r.summary()
    assert all(f.kind == "skipped" for f in point.failures.values()) and all(point.correct.values()), r.summary()


FAMILIES = moe_families()


# Phimoe routes by sampling in training, through an autograd.Function vmap cannot run (skipped, below)
@pytest.mark.parametrize(
    "name,train",
    [(k, t) for k in FAMILIES if "Switch" not in k for t in (False, True) if not (t and "Phimoe" in k)],
)
def test_a_sparse_moe_block_of_each_family_is_recognised_by_its_structure_and_fused(name, train):
    """DBRX's router gives scores alone and its experts are flattened [E·f, d]; GraniteMoe's, Jamba's and
    Phimoe's routers are called `router`: each block, alone or in its decoder layer, is one block of N·E
    experts, whose outputs and gradients are the separate blocks'."""
    cls, kwargs, inputs = FAMILIES[name]
    torch.manual_seed(0)
    models = [without_dropout(cls(**kwargs)).train(train) for _ in range(3)]
    wide = custom_wide(models, "surgery")
    assert any(isinstance(m, WideSparseMoe) for m in wide.modules()), "its MoE block is swapped whole"
    assert_like_the_separate_calls(wide, models, inputs, train)


@pytest.mark.parametrize(
    "name,mode,skipped",
    [
        # its router moves its classifier with Module.to() in forward, a `.data` write vmap refuses
        ("SwitchTransformersSparseMLP", "inference", {"vmap": "`.data`", "surgery": "torch.export"}),
        # and in training its router's jitter multiplies its input in place: measured, not failed
        ("SwitchTransformersSparseMLP", "train_step", {"vmap": "`.data`", "surgery": "torch.export"}),
        ("PhimoeDecoderLayer", "train_step", {"vmap": "aten::nonzero", "surgery": "setup_context"}),
    ],
)
def test_what_torch_cannot_run_of_a_moe_family_is_skipped_with_the_reason(name, mode, skipped, fast_timing):
    cls, kwargs, inputs = FAMILIES[name]
    r = benchmark_custom(cls, None, [2], model_kwargs=kwargs, input_factory=inputs, device="cpu", verbose=False,
                         timing=fast_timing, confirm="none", mode=mode,
                         randomness="different" if mode == "train_step" else "error")  # fmt: skip
    point = r.points[0]
    for strategy, why in skipped.items():
        failure = point.failures[strategy]
        assert failure.kind == "skipped" and why in failure.message, r.summary()


@pytest.mark.parametrize("name", ["LlamaDecoderLayer", "LlamaMLP", "T5LayerFF", "BertLayer"])
def test_a_layer_that_routes_no_tokens_is_no_sparse_moe_block(name):
    """Attention's square projections beside one another, a GLU's matrices: none is a router beside
    stacked experts (an attention's o_proj was once taken for DBRX-like experts)."""
    cls, kwargs, _ = LAYERS[name]
    assert not any(is_sparse_moe(m) for m in cls(**kwargs).modules())
