"""Per-model rates (widen.rates): models that differ only in a dropout's p or a LeakyReLU's slope
fuse, each model computing with its own, as each separate model does."""

import copy

import pytest
import torch
from torch import nn

import wide_tessera as wt
from wide_tessera.core.errors import WideTesseraError
from wide_tessera.ops.lora import LoRALinear
from wide_tessera.widen.rates import with_own_rates

RATES = [(0.0, 0.0), (0.2, 0.01), (0.5, 0.1), (0.9, 0.3)]  # (dropout p, LeakyReLU slope) per model
RATES_AND_ALPHAS = [(1.0, 0.0, 0.01), (4.0, 0.1, 0.2), (9.0, 0.3, 0.5)]  # (LoRA alpha, its dropout p, a slope)


def models(rates=RATES):
    made = []
    for p, slope in rates:
        torch.manual_seed(1)  # one set of weights: only the rates differ
        made.append(nn.Sequential(nn.Linear(8, 16), nn.Dropout(p), nn.LeakyReLU(slope), nn.Linear(16, 4)))
    return made


def inputs():
    return [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(len(RATES))]


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_models_differing_in_rates_fuse_and_each_computes_with_its_own(strategy):
    """Under randomness 'same' (the draws the project checks dropout with: the wide call and each
    separate call from one generator state), model i's output is the separate model's, its own
    rate's form (the N-th model's p=0.9 drops 90%, the first's p=0 nothing)."""
    given = models()
    fused = wt.fuse(given, strategy=strategy, randomness="same")
    torch.manual_seed(3)
    got = fused.unpack(fused(fused.pack(inputs())))
    for i, (model, x) in enumerate(zip(with_own_rates(given), inputs())):
        torch.manual_seed(3)
        torch.testing.assert_close(got[i], model(x), msg=f"model {i}")
    back = fused.unfuse()
    assert [(type(m[1]), m[1].p, m[2].negative_slope) for m in back] == [(nn.Dropout, p, s) for p, s in RATES]
    assert [type(m[1]) for m in given] == [nn.Dropout] * len(RATES)  # the models given are left as they were


def test_the_loop_runs_each_models_own_dropout():
    given = models()
    fused = wt.fuse(given, strategy="loop")
    torch.manual_seed(3)
    got = fused.unpack(fused(fused.pack(inputs())))
    torch.manual_seed(3)
    want = [m(x) for m, x in zip(given, inputs())]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_surgery_traces_models_differing_in_dropout_rate_with_torch_fx_and_follows_eval():
    """A rate's dropout reads its own `training` at each call, as nn.Dropout does: traced through,
    torch.fx's graphs of the two modes differed, and such models went to a torch.export capture
    (0.7 to 4.5 s a build on the 2-core CPU, paid at every probe's switch to surgery)."""
    given = models()
    fused = wt.fuse(given, strategy="surgery", randomness="same")
    (surgery,) = [m for m in fused.modules() if hasattr(m, "what_ran")]
    assert surgery.what_ran().startswith("torch.fx graph"), surgery.what_ran()
    fused(fused.pack(inputs()))  # a call in training mode first
    got = fused.unpack(fused.eval()(fused.pack(inputs())))
    for i, (model, x) in enumerate(zip(given, inputs())):
        torch.testing.assert_close(got[i], model.eval()(x), msg=f"model {i}")


@pytest.mark.parametrize("p", [0.0, 0.3, 0.9, 1.0])
def test_a_rate_held_as_a_buffer_drops_as_nn_dropout_drops(p):
    """In law: the share of elements kept, their scale, and nothing in eval mode."""
    (model,) = with_own_rates([nn.Sequential(nn.Dropout(p))])
    x = torch.ones(200_000)
    out = model(x)
    kept = out != 0
    assert kept.float().mean().item() == pytest.approx(1 - p, abs=0.01)
    if p < 1:
        assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / (1 - p)))
    assert torch.equal(model.eval()(x), x)


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_models_differing_in_rates_train_as_the_separate_models(strategy):
    """Five AdamW steps with dropout active, each step's draws from one seed on both sides."""
    given = models()
    separate = with_own_rates(given)
    fused = wt.fuse(given, strategy=strategy, randomness="same")
    opt = wt.optim.AdamW(fused, lr=1e-2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in separate]
    for step in range(5):
        xs = [x + step for x in inputs()]
        torch.manual_seed(step)
        sum(o.square().mean() for o in fused.unpack(fused(fused.pack(xs)))).backward()
        opt.step()
        opt.zero_grad()
        for m, o, x in zip(separate, opts, xs):
            torch.manual_seed(step)
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for i, (trained, want) in enumerate(zip(fused.state_dicts(), separate)):
        for name, t in want.state_dict().items():
            torch.testing.assert_close(trained[name], t, atol=1e-5, rtol=1e-4, msg=f"model {i} {name}")


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_lora_layers_differing_in_alpha_fuse_each_with_its_own_scaling_over_one_base(strategy):
    """A LoRA layer's scaling (alpha / rank) is a rate: kept as a float, every alpha was a
    configuration of its own. The base all the layers hold stays one tensor, the given one."""
    base = nn.Linear(8, 8).requires_grad_(False)
    torch.manual_seed(1)
    given = [LoRALinear(base, 2, alpha, p) for alpha, p in [(1.0, 0.0), (4.0, 0.1), (9.0, 0.2)]]
    fused = wt.fuse(given, strategy=strategy, randomness="same")
    xs = inputs()[: len(given)]
    for out, m, x in zip(fused.unpack(fused.eval()(fused.pack(xs))), given, xs):
        torch.testing.assert_close(out, m.eval()(x))
    back = fused.unfuse()
    assert [(type(m), m.scaling) for m in back] == [(LoRALinear, alpha / 2) for alpha in (1.0, 4.0, 9.0)]
    assert {m.base.weight.data_ptr() for m in back} == {base.weight.data_ptr()}


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_peft_models_differing_in_lora_alpha_and_dropout_fuse_each_with_its_own(strategy):
    """PEFT's LoRA layers keep alpha and scaling as dicts of floats by adapter name: every alpha
    was a configuration of its own, refused by fuse() and a group of one in a sweep. Each model
    computes with its own scaling, its base the one frozen tensor; unfuse gives PEFT's dicts back."""
    peft = pytest.importorskip("peft")
    base = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).requires_grad_(False)
    given = []
    for alpha, p in [(1.0, 0.0), (4.0, 0.1), (16.0, 0.3)]:
        config = peft.LoraConfig(r=2, lora_alpha=alpha, lora_dropout=p, target_modules=["0", "2"])
        model = peft.get_peft_model(base, config) if not given else peft.get_peft_model(copy.deepcopy(base), config)
        for name, t in model.named_parameters():
            if "lora_B" in name:  # PEFT's zeros would leave the scaling out of the output
                nn.init.normal_(t, generator=torch.Generator().manual_seed(len(given)))
        given.append(model)
    fused = wt.fuse(given, strategy=strategy, randomness="same")
    xs = inputs()[: len(given)]
    for out, m, x in zip(fused.unpack(fused.eval()(fused.pack(xs))), given, xs):
        torch.testing.assert_close(out, m.eval()(x))
    back = fused.unfuse()
    assert [dict(m.base_model.model[0].scaling) for m in back] == [{"default": a / 2} for a in (1.0, 4.0, 16.0)]


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_rate_multiplies_as_torch_multiplies_by_the_float_in_every_dtype(strategy, dtype):
    """Held as a float32 tensor and multiplied in the output's dtype, a bfloat16 model's LoRA
    scaling and LeakyReLU slope were rounded to bfloat16 first (2.3e-3 to 5e-3 off the separate
    calls, which multiply in float32), and a float64 model's to float32 (5e-8 off). Weights and
    inputs are small integers, so every sum is exact in any order: only the rates can round."""

    def integers(*shape):
        return torch.randint(-1, 2, shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)

    base = nn.Linear(8, 8).to(dtype).requires_grad_(False)
    with torch.no_grad():
        base.weight.copy_(integers(8, 8)), base.bias.zero_()
    given = []
    for alpha, slope in [(16.0, 0.01), (7.0, 0.3), (5.0, 1 / 3), (1.0, 0.7)]:
        lora = LoRALinear(base, 3, alpha).to(dtype)  # 16 / 3 is neither a bfloat16 nor a float32
        with torch.no_grad():
            lora.lora_A.weight.copy_(integers(3, 8)), lora.lora_B.weight.copy_(integers(8, 3))
        given.append(nn.Sequential(lora, nn.LeakyReLU(slope)).eval())
    fused = wt.fuse(given, strategy=strategy)
    xs = [torch.randint(-3, 4, (5, 8), generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(4)]
    for i, (out, m, x) in enumerate(zip(fused.unpack(fused.eval()(fused.pack(xs))), given, xs)):
        assert torch.equal(out, m(x)), f"model {i}: {(out - m(x)).abs().max().item():.3g} off"


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_fusing_models_of_different_rates_leaves_the_given_models_as_they_were(strategy):
    """The copies that hold each model's rates share its tensors and the submodules holding no
    rate: a step of the fused models must change none of the given models' tensors, layers or
    settings (the fused weights are given back by unfuse)."""
    base = nn.Linear(8, 8).requires_grad_(False)
    given = [nn.Sequential(LoRALinear(base, 2, alpha, p), nn.LeakyReLU(s)) for alpha, p, s in RATES_AND_ALPHAS]
    before = [copy.deepcopy(m.state_dict()) for m in given]
    layers = [[(name, type(sub)) for name, sub in m.named_modules()] for m in given]
    fused = wt.fuse(given, strategy=strategy, randomness="same")
    sum(o.square().sum() for o in fused.unpack(fused(fused.pack(inputs()[: len(given)])))).backward()
    wt.optim.SGD(fused, lr=0.5).step()
    for m, state, kinds, (alpha, p, slope) in zip(given, before, layers, RATES_AND_ALPHAS):
        assert [(name, type(sub)) for name, sub in m.named_modules()] == kinds
        assert (m[0].scaling, m[0].dropout.p, m[1].negative_slope) == (alpha / 2, p, slope)
        assert all(torch.equal(t, state[name]) for name, t in m.state_dict().items())
    assert any(not torch.equal(a, b) for a, b in zip(fused.unfuse()[0].state_dict().values(), before[0].values()))


def test_models_that_differ_in_more_than_a_rate_are_still_refused():
    a, b = models()[:2]
    b[0].eps_like_setting = 3  # a plain setting that is no rate
    with pytest.raises(WideTesseraError, match="eps_like_setting"):
        wt.fuse([a, b], strategy="vmap", randomness="same")


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_a_leaky_relu_at_exactly_zero_takes_its_slopes_gradient_as_torch_does(strategy):
    """x >= 0 took x's gradient at 0, where torch takes the slope's: a zero bias on zero-padded
    rows stepped 0.97 off the separate models."""
    import copy

    import wide_tessera.optim as wto

    made = []
    for slope in (0.01, 0.3, 0.5):
        torch.manual_seed(1)
        layer = nn.Linear(8, 4)
        nn.init.zeros_(layer.bias)
        made.append(nn.Sequential(layer, nn.LeakyReLU(slope), nn.Linear(4, 1)))
    xs = [torch.zeros(3, 8) for _ in made]  # every pre-activation exactly 0
    fused = wt.fuse([copy.deepcopy(m) for m in made], strategy=strategy)
    sum(out.sum() for out in fused.unpack(fused(fused.pack(xs)))).backward()
    wto.SGD(fused, lr=1.0).step()
    for m, x in zip(made, xs):
        m(x).sum().backward()
        torch.optim.SGD(m.parameters(), lr=1.0).step()
    for ours, theirs in zip(fused.unfuse(), made):
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b)


def _kept_as(kind, slope):
    import dataclasses
    import functools
    import types

    import torch.nn.functional as F

    if kind == "dataclass":
        return dataclasses.make_dataclass("Config", [("slope", float)])(slope)
    if kind == "SimpleNamespace":
        return types.SimpleNamespace(slope=slope)
    if kind == "partial":
        return functools.partial(F.leaky_relu, negative_slope=slope)
    return lambda x: F.leaky_relu(x, slope)


class _Keeps(nn.Module):
    def __init__(self, kind, slope):
        super().__init__()
        self.kind, self.kept, self.fc = kind, _kept_as(kind, slope), nn.Linear(8, 8)

    def forward(self, x):
        import torch.nn.functional as F

        y = self.fc(x)
        return F.leaky_relu(y, self.kept.slope) if self.kind in ("dataclass", "SimpleNamespace") else self.kept(y)


@pytest.mark.parametrize("kind", ["dataclass", "SimpleNamespace", "partial", "closure"])
@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_a_setting_kept_in_a_config_object_is_compared(kind, strategy):
    """Models whose slope lay in a config object, a partial or a closure fused, and every model ran
    model 0's slope (0.69 and 5.2 off): such settings are compared, and alike models still fuse."""
    with pytest.raises(WideTesseraError, match="module 1's 'kept"):
        wt.fuse([_Keeps(kind, s) for s in (0.01, 0.5, 3.0)], strategy=strategy)
    alike = [_Keeps(kind, 0.2) for _ in range(3)]
    fused = wt.fuse(alike, strategy=strategy)
    xs = [torch.randn(4, 8) for _ in alike]
    for out, m, x in zip(fused.unpack(fused(fused.pack(xs))), alike, xs):
        torch.testing.assert_close(out, m(x))
