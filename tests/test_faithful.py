"""Fusing computes what the N separate calls compute, and leaves the models as they were, or
says why not: the user's modules are never run by a capture, a layer is swapped for an op's wide
module only when it computes that op, and what torch's vmap cannot run is skipped with the reason."""

import copy
import pickle
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from wide_tessera import DispatchTable, WideTesseraError, benchmark_custom, fuse
from wide_tessera.core.errors import NotApplicable
from wide_tessera.core.layout import STACKED
from wide_tessera.dispatch import fuse as fusing
from wide_tessera.dispatch.fuse import DispatchWarning
from wide_tessera.ops.conv import WideConv2d
from wide_tessera.widen.surgery import WideSurgery

from .helpers import entry


def assert_same_as_separate_calls(wide, models, inputs):
    with torch.no_grad():
        for got, model, x in zip(wide.unpack(wide(wide.pack(inputs))), models, inputs):
            torch.testing.assert_close(got, model(x))


# --- a capture runs a copy, never the user's module ----------------------------------------------


class KeepsDtype(nn.Module):
    """Keeps its input's dtype on self, as transformers' SwitchTransformersTop1Router does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        self.last_dtype = x.dtype
        return self.fc(x)


class KeepsDtypeAndBranches(KeepsDtype):
    """The same, then a branch torch.fx cannot trace: torch.export captures it."""

    def forward(self, x):
        self.last_dtype = x.dtype
        return self.fc(x) if x.dim() == 2 else x


@pytest.mark.parametrize("model", [KeepsDtype, KeepsDtypeAndBranches])
def test_surgery_captures_a_copy_and_leaves_the_models_as_they_were(model):
    models = [model() for _ in range(3)]
    before = [copy.deepcopy(m.state_dict()) for m in models]
    wide = WideSurgery(models)
    for m, state in zip(models, before):
        assert "last_dtype" not in vars(m)  # torch.fx left a Proxy there
        pickle.dumps(copy.deepcopy(m))
        torch.testing.assert_close(m.state_dict(), state)
    assert wide.swapped == ["fc"]
    assert_same_as_separate_calls(wide, models, [torch.randn(4, 8) for _ in range(3)])


# --- a layer is swapped for an op's wide module only where it computes that op -------------------


class BatchNormAct2d(nn.BatchNorm2d):
    """As timm's: a BatchNorm2d whose forward also applies its activation."""

    def forward(self, x):
        return F.relu(super().forward(x))


class InvertedResidual(nn.Module):
    """As timm's (MobileNetV2's block): 1x1 expansion, depthwise 3x3 and 1x1 projection, each
    followed by a norm, the first two with their activation; a residual around it all."""

    def __init__(self, c=4, hidden=8):
        super().__init__()
        self.conv_pw, self.bn1 = nn.Conv2d(c, hidden, 1, bias=False), BatchNormAct2d(hidden)
        self.conv_dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)  # grouped: looped
        self.bn2 = BatchNormAct2d(hidden)
        self.conv_pwl, self.bn3 = nn.Conv2d(hidden, c, 1, bias=False), nn.BatchNorm2d(c)
        for norm in (self.bn1, self.bn2, self.bn3):  # not a fresh norm's identity: a lost ReLU shows
            nn.init.normal_(norm.weight)
            nn.init.normal_(norm.bias)
            norm.running_mean.normal_()

    def forward(self, x):
        y = self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))
        return x + self.bn3(self.conv_pwl(y))


class InvertedResidualOfAnyRank(InvertedResidual):
    """The same, and a branch torch.fx cannot trace: torch.export captures it."""

    def forward(self, x):
        return super().forward(x) if x.dim() == 4 else x


def test_a_stacked_value_moves_into_the_channels_layout_and_back_as_views():
    """Surgery runs a convolution or a channel norm on the N models' channels side by side: the
    stacked value moved there is the N parts joined, and moved back, a view of the op's output,
    which the next channel layer takes in again uncopied (joining N parts and stacking them again
    cost a quarter of a training step of 16 small conv nets)."""
    n, io = 3, WideConv2d.IO_LAYOUT
    x = torch.randn(n, 2, 4, 5, 5)
    joined = STACKED.relaid(x, n, io)
    assert torch.equal(joined, io.join(list(x.unbind(0))))
    back = io.relaid(joined, n, STACKED)
    assert torch.equal(back, x)
    assert back.data_ptr() == joined.data_ptr() == STACKED.relaid(back, n, io).data_ptr()


class _Gram(nn.Module):
    """A conv's output viewed whole (a style loss's Gram matrix), and a norm after it."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        f = self.norm(self.conv(x))
        b, c, h, w = f.shape
        f = f.view(b * c, h * w)
        return f @ f.t()


class _WritesThroughItsView(_Gram):
    """Writes into a view of the norm's output, then reads the output itself."""

    def forward(self, x):
        f = self.norm(self.conv(x))
        f.view(-1).mul_(2)
        return f.sum((2, 3))


@pytest.mark.parametrize("model,batch", [(_Gram, 2), (_Gram, 0), (_WritesThroughItsView, 2)])
def test_a_channel_layer_hands_on_a_view_only_to_another_and_its_output_is_viewed_as_each_models(model, batch):
    """A swapped convolution hands its output to the next channel layer as a view of its
    [B, N*C, ...] layout; handed to anything else, a model's `f.view(b * c, h * w)` raised "view
    size is not compatible" (a reshape in its stead lost the model's writes through its view),
    and a batch of 0 could not be moved back ("cannot reshape tensor of 0 elements")."""
    torch.manual_seed(0)
    models = [model().eval() for _ in range(3)]
    xs = [torch.randn(batch, 3, 5, 5) for _ in models]
    fused = fuse(models, strategy="surgery")
    for got, m, x in zip(fused.unpack(fused(fused.pack(xs))), models, xs):
        torch.testing.assert_close(got, m(x))
    relaid = {type(m.wide).__name__: m.view_out for m in fused.modules() if hasattr(m, "view_out")}
    assert relaid == {"WideConv2d": True, "WideBatchNorm2d": False}


@pytest.mark.parametrize("mode", ["inference", "train_step"])
def test_a_block_whose_norms_also_activate_is_fused_correctly(mode, fast_timing):
    r = benchmark_custom(
        InvertedResidual, (2, 4, 5, 5), [2], mode=mode, device="cpu", verbose=False, timing=fast_timing, confirm="none"
    )
    assert r.points[0].correct == {"vmap": True, "surgery": True}, r.summary()


@pytest.mark.parametrize("model", [InvertedResidual, InvertedResidualOfAnyRank])
def test_surgery_runs_a_subclass_with_its_own_forward_as_itself_and_says_so(model):
    models = [model().eval() for _ in range(3)]
    wide = WideSurgery(models)
    assert (wide.captured is None) == (model is InvertedResidual)
    assert wide.swapped == ["conv_pw", "conv_pwl", "bn3"] and sorted(wide.looped) == ["bn1", "bn2", "conv_dw"]
    assert_same_as_separate_calls(wide, models, [torch.randn(2, 4, 5, 5) for _ in range(3)])


class LinearAct(nn.Linear):
    """An nn.Linear whose own forward also activates: torch.fx traces it to another graph than nn.Linear's."""

    def forward(self, x):
        return super().forward(x).tanh()


def hooked_linear(d_in, d_out):
    linear = nn.Linear(d_in, d_out)
    linear.register_forward_hook(lambda module, inputs, output: output.relu())
    return linear


class TwoLayers(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.fc1, self.fc2 = first(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.fc1(x))


@pytest.mark.parametrize("first", [LinearAct, hooked_linear])
def test_a_layer_that_computes_more_than_its_class_is_not_swapped(first):
    models = [TwoLayers(first) for _ in range(3)]
    wide = WideSurgery(models)
    assert wide.swapped == ["fc2"] and wide.looped == ["fc1"]
    assert_same_as_separate_calls(wide, models, [torch.randn(4, 8) for _ in range(3)])


def test_surgery_of_a_model_with_hooks_of_its_own_runs_them():
    models = [TwoLayers(nn.Linear) for _ in range(3)]
    for m in models:
        m.register_forward_hook(lambda module, inputs, output: output.relu())
    wide = WideSurgery(models)  # torch.fx would trace forward alone: torch.export captures the hooks too
    assert wide.captured is not None and wide.swapped == ["fc1", "fc2"]
    assert_same_as_separate_calls(wide, models, [torch.randn(4, 8) for _ in range(3)])


def test_fuse_takes_a_subclass_with_its_own_forward_for_a_class_of_its_own(monkeypatch):
    monkeypatch.setattr(fusing, "_warned", set())  # warned once per case in a process
    norms = [InvertedResidual().bn1.eval() for _ in range(3)]
    inputs = [torch.randn(2, 8, 5, 5) for _ in range(3)]
    # fusing wins for BatchNorm2d: not for a BatchNorm2d that also activates
    table = DispatchTable([entry(op="batchnorm2d", params={"channels": 8}, strategy="stacked", verdicts="fuse:2")])
    with pytest.warns(DispatchWarning, match="no measured entry for BatchNormAct2d x3"):
        fused = fuse(norms, table=table)
    assert fused.decision.case.op == "BatchNormAct2d"
    assert_same_as_separate_calls(fused, norms, inputs)
    assert_same_as_separate_calls(fuse(norms, strategy="surgery"), norms, inputs)
    with pytest.raises(WideTesseraError, match="BatchNormAct2d computes something of its own where BatchNorm2d"):
        fuse(norms, op="batchnorm2d", table=table)


# --- what torch's vmap cannot run is skipped with torch's reason, never failed ---------------------


class Doubled(torch.autograd.Function):
    """An autograd.Function of the old style, forward(ctx, ...) with no setup_context, as BloomBlock's GeLU."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class OldStyleFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return Doubled.apply(self.fc(x))


class Nonzero(nn.Module):
    """A data-dependent shape inside (how many inputs are positive), a fixed one out."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * len(torch.nonzero(x > 0))


@pytest.mark.parametrize("model,why", [(OldStyleFunction, "setup_context"), (Nonzero, "aten::nonzero")])
@pytest.mark.parametrize("mode", ["inference", "train_step"])
def test_what_torch_vmap_cannot_run_is_skipped_with_its_reason(model, why, mode, fast_timing):
    r = benchmark_custom(model, (4, 8), [2], mode=mode, device="cpu", verbose=False, timing=fast_timing, confirm="none")
    point = r.points[0]
    vmap = point.failures["vmap"]
    assert vmap.kind == "skipped" and vmap.message.startswith("vmap: torch's vmap cannot run it: RuntimeError: ")
    assert why in vmap.message and "\n" not in vmap.message
    assert all(f.kind == "skipped" for f in point.failures.values()) and all(point.correct.values()), r.summary()


# --- an argument torch.fx traced as None, given ----------------------------------------------------


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale=None):
        y = self.fc(x)
        return y if scale is None else y * scale


def test_surgery_refuses_in_one_line_a_call_giving_an_argument_it_traced_as_none(fast_timing):
    models = [Scaled() for _ in range(3)]
    wide = WideSurgery(models)
    assert_same_as_separate_calls(wide, models, [torch.randn(4, 8) for _ in range(3)])  # scale left at None
    why = "surgery: torch.fx traced Scaled with scale=None .* cannot run a call that gives scale; the vmap strategy can"
    for given in ((torch.randn(4, 8), torch.randn(4, 8)), {"x": torch.randn(4, 8), "scale": torch.randn(4, 8)}):
        with pytest.raises(NotApplicable, match=why):  # by position, it raised torch.fx's AssertionError
            wide(wide.pack([given] * 3))
    r = benchmark_custom(Scaled, [(4, 8), (4, 8)], [2], device="cpu", verbose=False, timing=fast_timing)
    point = r.points[0]
    assert point.correct == {"vmap": True} and point.failures["surgery"].kind == "skipped", r.summary()



def test_only_torchs_own_vmap_refusals_are_limitations():
    """A user's error quoting torch's words was skipped as torch's limitation: a skipped strategy
    counts as neither correct nor incorrect, so a real bug hid there."""
    from torch.func import vmap

    from wide_tessera.core.errors import vmap_limitation

    with pytest.raises(RuntimeError) as torchs:
        vmap(torch.nonzero)(torch.ones(3, 2))
    assert vmap_limitation(torchs.value) is not None
    assert vmap_limitation(RuntimeError("my_kernel: Batching rule not implemented for this dtype")) is None
    assert vmap_limitation(ValueError("Batching rule not implemented for aten::gru")) is None
    with pytest.raises(RuntimeError) as branch:  # transformers' SDPA masks, once the models' masks differ
        vmap(lambda mask: mask if mask.all() else ~mask)(torch.tensor([[True], [False]]))
    assert "which vmap cannot take per model" in vmap_limitation(branch.value)
    assert "per model" not in vmap_limitation(torchs.value)


class Standardised(nn.Conv2d):
    """Weight standardisation through the method forward calls: forward itself is Conv2d's."""

    def _conv_forward(self, x, weight, bias):
        weight = (weight - weight.mean(dim=(1, 2, 3), keepdim=True)) / (weight.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return super()._conv_forward(x, weight, bias)


class ScaledByItsOwn(nn.Linear):
    """Branches on its own attribute: model 0's trace is the base's, the others' are not."""

    def __init__(self, scale):
        super().__init__(4, 4)
        self.scale = scale

    def forward(self, x):
        y = super().forward(x)
        return y if self.scale == 1 else y * self.scale


def test_a_subclass_overriding_a_method_its_forward_calls_is_not_the_op():
    """Conv2d's forward with weight standardisation in _conv_forward was swapped: an error of 16.1."""
    torch.manual_seed(0)
    models = [Standardised(3, 4, 3) for _ in range(3)]
    x = torch.randn(2, 3, 8, 8)
    wide = WideSurgery(models)
    assert wide.swapped == []
    for got, model in zip(wide.unpack(wide(wide.pack([x] * 3))), models):
        torch.testing.assert_close(got, model(x))


def test_models_whose_settings_differ_are_refused_in_one_line_not_run_with_model_0s():
    """vmap, surgery and a wide module run model 0's code and settings with each model's tensors:
    models scaled 1, 2, 3 came out as model 0's (3.24 off), and so would LayerNorms of other eps."""
    for models, named in (
        ([ScaledByItsOwn(i + 1) for i in range(3)], "'scale' is 2 but module 0's is 1"),
        ([nn.LayerNorm(4, eps=e) for e in (1e-5, 1e-3)], "'eps' is 0.001 but module 0's is 1e-05"),
    ):
        for strategy in ("vmap", "surgery"):
            with pytest.raises(WideTesseraError, match=named):
                fuse(models, strategy=strategy)


def test_models_whose_layers_differ_in_class_alone_are_refused_not_run_with_model_0s():
    """An activation chosen per model (nn.ReLU and nn.SiLU keep the same settings): vmap and surgery
    ran model 0's ReLU for both (0.28 off); and N classes of one sweep, one shape each."""
    models = [nn.Sequential(nn.Linear(4, 4), act()) for act in (nn.ReLU, nn.SiLU)]
    for strategy in ("vmap", "surgery", None):
        with pytest.raises(WideTesseraError, match=r"'1 \(its class\)' is a torch.nn.modules.activation.SiLU"):
            fuse(models, strategy=strategy)


class Shift(NamedTuple):
    scale: float
    shift: float


class KeepsOutsideItsState(nn.Linear):
    """Settings in a dict, or a tensor attribute that is neither a parameter nor a buffer."""

    def __init__(self, cfg, table):
        super().__init__(4, 4)
        self.cfg, self.table = cfg, table

    def forward(self, x):
        return super().forward(x) * self.cfg["scale"] * self.table


def test_models_whose_settings_in_a_dict_or_tensor_attributes_differ_are_refused_in_one_line():
    """Neither is stacked: model 0's were run for all (a per-model table 0.97 off, a scale in a
    dict 1.32 off). Alike ones are taken. A tensor frozen in one model alone
    raised torch's error from stack_module_state."""
    table = torch.randn(4)
    for models, named in (
        ([KeepsOutsideItsState({"scale": i + 1.0}, table) for i in range(3)], "'cfg' is {'scale': 2.0} but"),
        ([KeepsOutsideItsState({"scale": 1.0}, torch.randn(4)) for _ in range(3)], "'table' holds other values"),
        ([nn.Linear(4, 4), nn.Linear(4, 4).requires_grad_(False)], "'weight' is frozen in some of the models"),
        ([KeepsOutsideItsState({0: i}, table) for i in range(3)], "'cfg' is {0: 1} but"),
        ([KeepsOutsideItsState({"scale": torch.tensor(i)}, table) for i in range(3)], "'cfg' holds other values"),
        ([KeepsOutsideItsState([torch.tensor(i)], table) for i in range(3)], "'cfg' holds other values"),
        ([KeepsOutsideItsState(slice(0, i), table) for i in range(3)], "'cfg' is slice\\(0, 1, None\\) but"),
    ):
        for strategy in ("vmap", "surgery"):
            with pytest.raises(WideTesseraError, match=named):
                fuse(models, strategy=strategy)
    table[0] = float("nan")  # alike, NaN where the others have NaN
    alike = [KeepsOutsideItsState({"scale": 2.0}, table.clone()) for _ in range(3)]
    for m in alike:  # (a NamedTuple was rebuilt from one list: fusing raised a TypeError)
        m.kept = Shift(2.0, 1.0)
    wide = fuse(alike, strategy="vmap")
    x = torch.randn(2, 4)
    for got, model in zip(wide.unpack(wide(wide.pack([x] * 3))), alike):
        torch.testing.assert_close(got, model(x), equal_nan=True)


def test_models_whose_hooks_differ_are_refused_in_one_line():
    """vmap and surgery run model 0's hooks for all: one on model 1 alone was dropped (4.4 off)."""
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)]
    models[1][1].register_forward_hook(lambda m, i, o: o * 2)
    for strategy in ("vmap", "surgery"):
        with pytest.raises(WideTesseraError, match="module 1's 'hooks on 1' is 1 but module 0's is 0"):
            fuse(models, strategy=strategy)


class ShapedByItsValues(nn.Module):
    """What vmap cannot batch: a shape its values decide; `branches`: a forward torch.fx cannot trace."""

    def __init__(self, branches):
        super().__init__()
        self.fc, self.branches = nn.Linear(8, 8), branches

    def forward(self, x):
        y = self.fc(x)
        if self.branches and x.shape[0] > 1:
            y = y * 2
        return (y > 0).nonzero().float().sum()


class ReadsARecurrentOutput(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize(
    "make,why",
    [
        (lambda: ShapedByItsValues(False), "torch's vmap cannot run it: RuntimeError: vmap: We do not support"),
        (lambda: ShapedByItsValues(True), "its shapes depend on its values"),
        (lambda: ReadsARecurrentOutput(nn.GRU(8, 8, batch_first=True, bidirectional=True)), "aten::gru"),
    ],
    ids=["torch.fx", "torch.export", "bidirectional GRU"],
)
def test_what_torch_vmap_cannot_run_in_a_wide_module_is_refused_in_one_line(make, why):
    """WideSurgery raised torch's 30-line traceback (or, through torch.export, a KeyError of ours:
    the size of nonzero's output was read before nonzero ran)."""
    models = [make() for _ in range(3)]
    wide = WideSurgery(models)
    with pytest.raises(NotApplicable) as caught:
        wide(wide.pack([torch.randn(2, 5, 8)] * 3))
    assert why in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
