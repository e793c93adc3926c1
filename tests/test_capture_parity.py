"""A model both captures take (torch.fx and torch.export, widen/capture.py) runs the same rewritten
graph whichever captured it: the same layers, and between them the ops themselves, with no more
calls around them on the export path than on the fx path."""

from typing import List

import pytest
import torch
from torch import nn

from wide_tessera.core.errors import NotApplicable
from wide_tessera.widen import capture
from wide_tessera.widen.exported import ExportedSurgery
from wide_tessera.widen.surgery import WideSurgery


class _Mlp(nn.Module):
    """Layers an op fuses, and between them an activation and a residual add: ops at once."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def _modules_entered(call) -> List[str]:
    """The classes of the modules one call of `call()` enters, in order."""
    entered: List[str] = []
    hook = nn.modules.module.register_module_forward_pre_hook(lambda m, _: entered.append(type(m).__name__))
    try:
        call()
    finally:
        hook.remove()
    return entered


def test_the_export_path_enters_no_more_modules_than_the_fx_path_and_computes_the_separate_calls():
    """On the layers both capture, a warm call through torch.export's graph entered 10 modules
    where torch.fx's entered 6: a Segment and its own graph module for each stretch between
    swapped layers, and torch.export's guards read again. Its stretches are now ops of the one
    graph, and the capture that took the last input takes its like without its guards."""
    models = [_Mlp().eval() for _ in range(4)]
    xs = [torch.randn(2, 3, 8) for _ in range(4)]
    wide_x = torch.stack(xs)
    fx_path = WideSurgery(models)
    export_path = ExportedSurgery(models, "error", "(forced)")
    assert fx_path.captured is None, "torch.fx traces the model"
    with torch.no_grad():
        fx_path(wide_x), export_path((wide_x,), {})  # the export path captures on its first call
        by_fx = _modules_entered(lambda: fx_path(wide_x))
        by_export = _modules_entered(lambda: export_path((wide_x,), {}))
        assert len(by_export) <= len(by_fx), (by_export, by_fx)
        assert not {"Segment", "GuardsFn"} & set(by_export), by_export
        want = torch.stack([m(x) for m, x in zip(models, xs)])
        torch.testing.assert_close(export_path((wide_x,), {}), want)
        torch.testing.assert_close(fx_path(wide_x), want)
        # another length (the same capture, its sizes dynamic) and one input all models share
        # (a capture of its own): each still what the separate calls give
        longer = torch.randn(2, 5, 8)
        shared = longer.expand(4, *longer.shape)
        with pytest.warns(UserWarning, match="captures _Mlp again"):
            torch.testing.assert_close(export_path((shared,), {}), torch.stack([m(longer) for m in models]))
        again = torch.stack([torch.randn(2, 5, 8) for _ in range(4)])
        torch.testing.assert_close(export_path((again,), {}), torch.stack([m(x) for m, x in zip(models, again)]))


class _Gelu(_Mlp):
    """_Mlp's layout, another class: a graph of its own."""


class _Shifted(_Mlp):
    """A constant made in forward, which the capture holds (not a tensor of the model's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])


def test_within_exports_kept_a_surgery_of_models_laid_out_alike_reuses_the_export_with_its_own_tensors(monkeypatch):
    """An Optuna group's probe switch and each repack after a pruned trial built a surgery of other
    models laid out alike, and exported again (0.27 s a time for a small conv net): within
    exports_kept (as an Optuna study runs) the graph is copied with the new models' tensors,
    each model computing with its own, and the graph kept holds no model's weights (a constant
    made in forward it holds: taken for a model's tensor, it was looked up on the next model and
    refused); outside it, every surgery exports its own."""
    exports = []
    original = capture._export
    monkeypatch.setattr(capture, "_export", lambda *a: exports.append(type(a[0])) or original(*a))
    x = torch.randn(3, 2, 8)

    def build_each(*kinds):
        for kind in kinds:
            models = [kind().train() for _ in range(3)]
            wide = ExportedSurgery(models, "error", "(forced)")
            torch.testing.assert_close(wide((x,), {}), torch.stack([m(x[i]) for i, m in enumerate(models)]))

    with capture.exports_kept():
        build_each(_Mlp, _Mlp, _Gelu, _Shifted, _Shifted)
        kept = [t for graph, _ in capture._KEPT.get().values() for t in graph.parameters()]
    assert exports == [_Mlp, _Gelu, _Shifted], "the second _Mlp and _Shifted surgeries reused the first's export"
    assert kept and all(t.is_meta for t in kept)
    exports.clear()
    build_each(_Mlp, _Mlp)
    assert exports == [_Mlp, _Mlp]


@pytest.mark.parametrize("path", ["torch.fx", "torch.export"])
def test_a_fused_model_saved_after_training_loads_and_computes_as_it_did(path, monkeypatch):
    """torch.save of a surgery-fused model wrote a file that failed to load (torch.fx rebuilds its
    graph with the tracer's class, which took an argument), or failed to write once it had run
    (torch.export's guards hold a function pickle cannot take): a loaded one captures again."""
    import io

    import wide_tessera as wt

    if path == "torch.export":  # as for a model torch.fx cannot trace
        monkeypatch.setattr("wide_tessera.widen.surgery.trace_fx", lambda m: (_ for _ in ()).throw(RuntimeError("no")))
    models = [_Mlp() for _ in range(3)]
    fused = wt.fuse(models, strategy="surgery")
    xs = [torch.randn(2, 8) for _ in models]
    sum(out.square().sum() for out in fused.unpack(fused(fused.pack(xs)))).backward()
    wt.optim.SGD(fused, lr=0.1).step()
    assert (fused.runs.captured is not None) == (path == "torch.export")
    saved = io.BytesIO()
    torch.save(fused, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    for got, want in zip(loaded.unpack(loaded(loaded.pack(xs))), fused.unpack(fused(fused.pack(xs)))):
        assert torch.equal(got, want)


class _Attention(nn.Module):
    """torch's attention, whose forward reads out_proj's weight without calling out_proj."""

    def __init__(self):
        super().__init__()
        self.mha, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mha(x, x, x, need_weights=False)[0])


def test_the_export_path_keeps_an_attention_layer_whole_and_computes_the_separate_calls():
    """The export path swapped nn.MultiheadAttention's out_proj (an nn.Linear), which torch's
    attention never calls: "mha.out_proj.weight is read outside its layer's call", and surgery
    refused a model holding one that torch.fx could not trace. It runs whole as its ops, as the
    fx path runs it, and the layers around it are still swapped."""
    models = [_Attention().eval() for _ in range(3)]
    xs = torch.randn(3, 2, 5, 8)
    wide = ExportedSurgery(models, "error", "(forced)")
    assert wide.looped == ["mha"] and wide.swapped == ["head"]
    with torch.no_grad():
        torch.testing.assert_close(wide((xs,), {}), torch.stack([m(x) for m, x in zip(models, xs)]))


class _ReadTwice(nn.Module):
    """A layer's weight also read outside its call; a grouped convolution's too, with `conv`."""

    def __init__(self, conv: bool = False):
        super().__init__()
        self.lin, self.conv = nn.Linear(4, 4), nn.Conv1d(4, 4, 1) if conv else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) + nn.functional.linear(x, self.lin.weight)
        if self.conv is not None:  # a grouped convolution holds its weight joined, not stacked
            column = x.unsqueeze(-1)
            y = y + (self.conv(column) + nn.functional.conv1d(column, self.conv.weight))[..., 0]
        return y


def test_the_export_path_holds_a_weight_read_outside_its_layer_as_the_layers_own_tensor():
    """torch.export's path refused a swapped layer's weight read again outside its call ("lin.weight
    is read outside its layer's call"), which torch.fx's path holds as one tensor. The read takes
    the wide layer's stacked weight: one tensor, whose gradient is each model's from both uses."""
    torch.manual_seed(0)
    models = [_ReadTwice() for _ in range(3)]
    xs = [torch.randn(5, 4) for _ in range(3)]
    export_path = ExportedSurgery(models, "error", "(forced)")
    out = export_path((torch.stack(xs),), {})
    torch.testing.assert_close(out, torch.stack([m(x) for m, x in zip(models, xs)]))
    out.square().sum().backward()
    for m, x in zip(models, xs):
        m(x).square().sum().backward()
    assert [name for name, _ in export_path.named_parameters()] == ["wides.w0.weight", "wides.w0.bias"]
    torch.testing.assert_close(export_path.wides.w0.weight.grad, torch.stack([m.lin.weight.grad for m in models]))
    joined = ExportedSurgery([_ReadTwice(conv=True) for _ in range(3)], "error", "(forced)")
    with pytest.raises(NotApplicable, match="conv.weight is read outside its layer's call"):
        joined((torch.stack(xs),), {})


class _Encoder(nn.Module):
    """A recurrent layer given the initial state the model learns (GRU: h0; LSTM: (h0, c0), or
    one tensor as both)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.rnn = getattr(nn, kind.split()[0])(4, 6, num_layers=2, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(2, 1, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.h0.expand(2, x.shape[0], 6).contiguous()
        state = {"GRU": h, "LSTM": (h, torch.tanh(h)), "LSTM (h, h)": (h, h)}[self.kind]
        out, _ = self.rnn(x, state)
        return out


@pytest.mark.parametrize("kind", ["GRU", "LSTM", "LSTM (h, h)"])
def test_the_export_path_swaps_a_recurrent_layer_given_its_initial_state(kind):
    """torch.export's path swapped a layer taking one value only ("layer rnn takes 2 values"), where
    torch.fx's swaps a recurrent layer given its state: the wide module takes both stacked."""
    torch.manual_seed(0)
    models = [_Encoder(kind) for _ in range(3)]
    xs = [torch.randn(2, 5, 4) for _ in range(3)]
    export_path = ExportedSurgery(models, "error", "(forced)")
    out = export_path((torch.stack(xs),), {})
    assert export_path.swapped == ["rnn"]
    torch.testing.assert_close(out, torch.stack([m(x) for m, x in zip(models, xs)]))
    out.square().sum().backward()
    for m, x in zip(models, xs):
        m(x).square().sum().backward()
    h0 = dict(export_path.named_parameters())[f"stacked.{export_path._stacked_names['h0']}"]
    torch.testing.assert_close(h0.grad, torch.stack([m.h0.grad for m in models]))


class _Jittered(nn.Module):
    """Writes its input in place, as transformers' SwitchTransformersSparseMLP's router jitter does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x *= 1.5
        return self.fc(x)


def test_a_capture_of_a_model_that_writes_its_input_in_place_writes_each_models_part_once():
    """Before torch.export captures a model, a copy of it is called on one model's input, which
    was a view of the stacked one: model 0's part was written twice (2.25x, not 1.5x), and its
    output was off from the first call on."""
    models = [_Jittered() for _ in range(2)]
    xs = [torch.randn(4, 8) for _ in models]
    stacked = torch.stack(xs)
    out = ExportedSurgery(models, "error", "(forced)")((stacked,), {})
    with torch.no_grad():
        want = torch.stack([m(x.clone()) for m, x in zip(models, xs)])
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(stacked, torch.stack(xs) * 1.5)  # written in place, as each model writes its own


class _OwnState(nn.Module):
    """An initial state the model keeps on its recurrent layer itself (`self.rnn.h0`)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 5, batch_first=True)
        self.rnn.h0 = nn.Parameter(torch.randn(1, 3, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x, self.rnn.h0)[0]


def test_the_export_path_holds_a_tensor_a_swapped_layer_keeps_beside_its_weights():
    """The wide GRU holds a GRU's weights; `rnn.h0`, which the model added to the layer, was
    neither held nor given: the wide GRU ran from zeros (1.9 off the separate models) and the
    fused model's tensors lacked it."""
    torch.manual_seed(0)
    models = [_OwnState() for _ in range(3)]
    xs = torch.randn(3, 3, 7, 4)
    export_path = ExportedSurgery(models, "error", "(forced)")
    out = export_path((xs,), {})
    assert export_path.swapped == ["rnn"]
    torch.testing.assert_close(out, torch.stack([m(x) for m, x in zip(models, xs)]))
    assert "rnn.h0" in {slot.name for slot in export_path.model_slots().values()}


class _EncoderOfState(_Encoder):
    def __init__(self):
        super().__init__("GRU")


@pytest.mark.parametrize("path", ["torch.fx", "torch.export"])
def test_a_recurrent_layer_given_its_state_runs_as_n_calls_where_its_op_loses(path):
    """A layer run as N calls (the table says its op loses) took its input alone: given a state
    too it raised a TypeError, and a GRU's (output, state) could not be stacked."""
    torch.manual_seed(0)
    models = [_EncoderOfState() for _ in range(3)]
    xs = [torch.randn(2, 5, 4) for _ in range(3)]
    loses = lambda op, layers: "loses here"  # noqa: E731
    if path == "torch.fx":
        out = WideSurgery(models, choice=loses)(torch.stack(xs))
    else:
        out = ExportedSurgery(models, "error", "(forced)", loses)((torch.stack(xs),), {})
    torch.testing.assert_close(out, torch.stack([m(x) for m, x in zip(models, xs)]))
