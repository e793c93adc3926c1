"""Layers of transformers models, as they are: built from tiny configs in code (no download),
called with their own keyword inputs, RoPE tables and optional arguments left at None, measured
by benchmark_custom and fused by fuse(), in inference and train_step."""

import sys
import warnings
from pathlib import Path

import pytest
import torch

from wide_tessera import DispatchTable, benchmark_custom, fuse
from wide_tessera.core import trees
from wide_tessera.widen.custom import model_identity

from .test_dispatch import entry

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from real_modules import catalogue  # noqa: E402  the catalogue scripts/real_modules.py measures at N=16

LAYERS = catalogue()
MOE = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock")


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
    assert r.op == name and all(point.correct.values()) and point.correct["vmap"], r.summary()
    # surgery runs where torch.fx traces the layer, and is skipped with torch.fx's reason elsewhere
    assert point.correct.get("surgery") or "torch.fx cannot trace" in point.failures["surgery"].message


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("name", list(LAYERS))
def test_fuse_gives_the_separate_calls_outputs_and_gradients(name, train):
    cls, kwargs, inputs = LAYERS[name]
    torch.manual_seed(0)
    models = [cls(**kwargs).train(train) for _ in range(3)]
    for m in models:
        for p in m.modules():  # the same dropout draws cannot be asked of two sides: train without it
            if isinstance(p, torch.nn.Dropout):
                p.p = 0.0
    key = {k: v for k, v in model_identity(models[0]).items() if k != "class"}
    strategy = "surgery" if name in MOE else "vmap"
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
    if name in MOE:  # model i's experts are experts i·E to (i+1)·E of the wide block
        joined = torch.cat([m.experts.gate_up_proj.grad for m in models])
        torch.testing.assert_close(fused.experts.gate_up_proj.grad, joined, rtol=1e-4, atol=1e-5)
        return
    stacked = dict(zip(fused._param_names, fused.stacked_params))
    for i, m in enumerate(models):
        for k, p in m.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(stacked[k].grad[i], p.grad, rtol=1e-4, atol=1e-5)
