"""What the training side takes as torch takes it (hyperparameters as tensors and NumPy values,
HFTA's per-coefficient betas, clipping without a limit), and what it refuses in one line naming
the value: each row a case that was taken wrongly, or raised a traceback."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import wide_tessera as wt
import wide_tessera.optim as wto

N = 3


def linears(n=N):
    torch.manual_seed(0)
    return [nn.Linear(4, 2) for _ in range(n)]


def fused(n=N, strategy="bmm"):
    return wt.fuse(linears(n), strategy=strategy)


# what each model's settings are, given as torch's own optimizers and HFTA's tests give them
TAKEN = {
    "lr a tensor": (lambda f: wto.SGD(f, lr=torch.tensor(0.5)), "lr", [0.5] * N),
    "lr a NumPy float32": (lambda f: wto.SGD(f, lr=np.float32(0.25)), "lr", [0.25] * N),
    "lr a NumPy array of N": (lambda f: wto.Adam(f, lr=np.array([0.1, 0.2, 0.3])), "lr", [0.1, 0.2, 0.3]),
    "weight decay a tensor of N": (
        lambda f: wto.AdamW(f, weight_decay=torch.tensor([0.0, 0.5, 0.25], dtype=torch.float64)),
        "weight_decay",
        [0.0, 0.5, 0.25],
    ),
    "betas per coefficient, beta2 per model": (
        lambda f: wto.Adam(f, betas=(0.9, [0.99, 0.999, 0.9])),
        "betas",
        [(0.9, 0.99), (0.9, 0.999), (0.9, 0.9)],
    ),
    "betas per coefficient, both per model (HFTA's)": (
        lambda f: wto.Adam(f, betas=([0.9, 0.8, 0.7], np.array([0.99, 0.999, 0.9]))),
        "betas",
        [(0.9, 0.99), (0.8, 0.999), (0.7, 0.9)],
    ),
    "betas as N pairs": (
        lambda f: wto.AdamW(f, betas=[(0.9, 0.99), (0.8, 0.999), (0.7, 0.9)]),
        "betas",
        [(0.9, 0.99), (0.8, 0.999), (0.7, 0.9)],
    ),
    "betas of 2 models read alike both ways": (
        lambda f: wto.Adam(fused(2), betas=((0.9, 0.99), (0.99, 0.999))),
        "betas",
        [(0.9, 0.99), (0.99, 0.999)],
    ),
}


@pytest.mark.parametrize("case", TAKEN)
def test_settings_are_taken_in_every_form_torch_and_hfta_give_them(case):
    make, key, want = TAKEN[case]
    opt = make(fused())
    assert [g[key] for g in opt.param_groups] == pytest.approx(want)


REFUSED = {
    # at N=2, ([b1 of 0, b1 of 1], [b2 of 0, b2 of 1]) was read as two pairs: model 0 got beta2 0.8
    "betas of 2 models that read two ways": (
        lambda: wto.Adam(fused(2), betas=([0.9, 0.8], [0.999, 0.99])),
        ["betas=([0.9, 0.8], [0.999, 0.99])", "reads two ways", "(0.9, 0.8)", "(0.9, 0.999)"],
    ),
    "betas of neither form": (lambda: wto.Adam(fused(), betas=(0.9,)), ["betas=(0.9,)", "or 3 pairs"]),
    "lr a string": (lambda: wto.SGD(fused(), lr="0.1"), ["lr='0.1'", "at least 0"]),
    "lr a tensor of the wrong length": (lambda: wto.SGD(fused(), lr=torch.tensor([0.1, 0.2])), ["lr=", "of 3"]),
    "norm_type a word": (lambda: wto.clip_grad_norm_(fused(), 1.0, "two"), ["norm_type='two'", "or inf"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_be_taken_is_one_line_naming_it(case):
    make, tokens = REFUSED[case]
    with pytest.raises(wt.WideTesseraError) as e:
        make()
    message = str(e.value)
    assert "\n" not in message
    for token in tokens:
        assert token in message, (token, message)


@pytest.mark.parametrize("max_norm,norm_type", [(math.inf, 2.0), (1e-3, "inf"), (0.5, np.float64(1.0))])
def test_clipping_takes_what_torchs_clipping_takes(max_norm, norm_type):
    """torch's clip_grad_norm_ takes max_norm=inf (no limit) and norm_type='inf' (read by float()):
    ours refused both as 'not a number at least 0'."""
    f = fused()
    separate = linears()
    xs = [torch.randn(5, 4) for _ in range(N)]
    sum(o.pow(2).sum() for o in f.unpack(f(f.pack(xs)))).backward()
    norms = wto.clip_grad_norm_(f, max_norm, norm_type)
    for i, (m, x) in enumerate(zip(separate, xs)):
        m(x).pow(2).sum().backward()
        want = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm, norm_type)
        torch.testing.assert_close(norms[i].float(), want)
        torch.testing.assert_close(f.runs.weight.grad[i], m.weight.grad)


def _states_of(kind, f):
    """Optimizer states of the N models after one step: torch's own format, as state_dicts() gives them."""
    opt = kind(f)
    sum(o.sum() for o in f.unpack(f(f.pack([torch.randn(5, 4) for _ in range(f.n)])))).backward()
    opt.step()
    return opt.state_dicts()


def _moment_of_another_shape():
    states = _states_of(wto.Adam, fused())
    states[1]["state"][0]["exp_avg"] = torch.zeros(3, 4)
    return wto.Adam(fused()).load_state_dicts(states)


def _two_modes():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 2), nn.Dropout(0.5)) for _ in range(N)]
    models[1].eval()
    return wt.fuse(models, strategy="vmap")


TAKEN_WRONGLY = {
    # accepted under vmap and loop: the two "models" were one set of weights, and unfuse(into=[m, m]) kept the last
    "one module given twice": (lambda: wt.fuse([linears(1)[0]] * 2, strategy="vmap"), ["module 1 is module 0"]),
    # taken, and Adam stepped on from SGD's momentum buffers
    "another optimizer's states": (
        lambda: wto.Adam(fused()).load_state_dicts(_states_of(lambda f: wto.SGD(f, momentum=0.9), fused())),
        ["state 0 has no betas, eps", "not Adam's"],
    ),
    "Adam's states into SGD": (
        lambda: wto.SGD(fused(), momentum=0.9).load_state_dicts(_states_of(wto.Adam, fused())),
        ["has no momentum", "not SGD's"],
    ),
    # taken, and step() failed on a size mismatch
    "a moment of another shape": (_moment_of_another_shape, ["state 1's exp_avg of weight", "[3, 4]", "[2, 4]"]),
    "freeze of a float": (lambda: wto.SGD(fused()).freeze(2.0), ["models=2.0", "from 0 to 2"]),
    # torch.func's RuntimeError from stack_module_state
    "vmap of models in train and eval mode": (_two_modes, ["strategy 'vmap'", "eval: modules [1]", "strategy='loop'"]),
    # its rows were returned as the N outputs
    "the loop's unpack of a tensor": (
        lambda: fused(strategy="loop").unpack(torch.randn(N, 2)),
        ["a tuple of 3 outputs", "Tensor of shape [3, 2]"],
    ),
}


@pytest.mark.parametrize("case", TAKEN_WRONGLY)
def test_what_was_taken_wrongly_or_raised_a_traceback_is_one_line(case):
    make, tokens = TAKEN_WRONGLY[case]
    with pytest.raises(wt.WideTesseraError) as e:
        make()
    message = str(e.value)
    assert "\n" not in message
    for token in tokens:
        assert token in message, (token, message)


# HFTA's optimizers and settings ours lacked: each model's part stepped bit for bit as torch's
# optimizer with that model's settings steps the model, given the same gradients
BIT_FOR_BIT = {
    "Adam amsgrad per model": (
        lambda f: wto.Adam(f, lr=[0.1, 0.01, 0.05], amsgrad=[True, False, True], weight_decay=0.1),
        lambda ps, i: torch.optim.Adam(ps, lr=[0.1, 0.01, 0.05][i], amsgrad=i != 1, weight_decay=0.1),
    ),
    "Adadelta per model": (
        lambda f: wto.Adadelta(f, lr=[1.0, 0.5, 0.1], rho=[0.9, 0.5, 0.99], eps=[1e-6, 1e-3, 1e-6], weight_decay=0.1),
        lambda ps, i: torch.optim.Adadelta(
            ps, lr=[1.0, 0.5, 0.1][i], rho=[0.9, 0.5, 0.99][i], eps=[1e-6, 1e-3, 1e-6][i], weight_decay=0.1
        ),
    ),
    "Adadelta shared": (lambda f: wto.Adadelta(f, lr=0.5), lambda ps, i: torch.optim.Adadelta(ps, lr=0.5)),
    "AdamW amsgrad foreach": (
        lambda f: wto.AdamW(f, lr=[0.1, 0.01, 0.05], amsgrad=True, implementation="foreach"),
        lambda ps, i: torch.optim.AdamW(ps, lr=[0.1, 0.01, 0.05][i], amsgrad=True, foreach=True),
    ),
}


@pytest.mark.parametrize("case", BIT_FOR_BIT)
def test_hftas_optimizers_step_each_model_bit_for_bit_as_torch(case):
    ours_of, theirs_of = BIT_FOR_BIT[case]
    f = fused()
    separate = linears()
    ours = ours_of(f)
    theirs = [theirs_of(m.parameters(), i) for i, m in enumerate(separate)]
    torch.manual_seed(1)
    for _ in range(5):
        for name in ("weight", "bias"):
            grads = [torch.randn_like(getattr(m, name)) for m in separate]
            getattr(f.runs, name).grad = torch.stack(grads)
            for m, g in zip(separate, grads):
                getattr(m, name).grad = g.clone()
        ours.step()
        for o in theirs:
            o.step()
    for i, m in enumerate(separate):
        assert torch.equal(f.runs.weight[i], m.weight) and torch.equal(f.runs.bias[i], m.bias), i
    for i, (state, o) in enumerate(zip(ours.state_dicts(), theirs)):  # torch's state, amsgrad's maximum where on
        want = o.state_dict()["state"]
        assert {j: sorted(s) for j, s in state["state"].items()} == {j: sorted(s) for j, s in want.items()}, i


def _torch_step_lr(i, lr, last_epoch):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    opt.param_groups[0]["initial_lr"] = 0.5
    return torch.optim.lr_scheduler.StepLR(opt, [2, 3, 1][i], [0.5, 0.1, 0.9][i], last_epoch=last_epoch)


@pytest.mark.filterwarnings("ignore:The epoch parameter", "ignore:Detected call")  # torch's, as for its StepLR
def test_step_lr_keeps_an_epoch_per_model_as_n_torch_step_lrs_do():
    """HFTA resumes each model's schedule at its own epoch and steps them to epochs of their own:
    a TypeError of ours (an int was expected)."""
    opt = wto.SGD(fused(), lr=[0.5, 0.25, 0.125])
    for group in opt.param_groups:
        group["initial_lr"] = 0.5
    lasts = [4, -1, 7]
    ours = wto.StepLR(opt, [2, 3, 1], [0.5, 0.1, 0.9], last_epoch=lasts)
    theirs = [_torch_step_lr(i, lr, last) for i, (lr, last) in enumerate(zip([0.5, 0.25, 0.125], lasts))]
    for step in range(6):
        epochs = [[10, 3, 5], None, 2][step % 3]
        ours.step(epochs) if epochs is not None else ours.step()
        for i, t in enumerate(theirs):
            t.step(epochs[i] if isinstance(epochs, list) else epochs) if epochs is not None else t.step()
        assert ours.epochs() == [t.last_epoch for t in theirs]
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([t.get_last_lr()[0] for t in theirs], rel=1e-12)


def test_step_lr_resuming_without_initial_lr_is_one_line():
    with pytest.raises(wt.WideTesseraError, match=r"model 0's schedule resumes at epoch 3.*'initial_lr'"):
        wto.StepLR(wto.SGD(fused()), 2, last_epoch=[3, -1, -1])


def _sequential(n=N):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(n)]


def test_unfused_layers_run_as_n_calls_inside_a_model_fused_by_surgery():
    """HFTA's partial fusion, public: before, only a dispatch table that says a layer's op loses."""
    f = wt.fuse(_sequential(), strategy="surgery", unfused=["2"])
    assert list(f.runs.unfused) == ["2"] and f.runs.swapped == ["0"]
    assert "layer 2 runs as 3 calls: named in unfused=" in str(f.decision)
    x = [torch.randn(5, 4) for _ in range(N)]
    for got, model, xi in zip(f.unpack(f(f.pack(x))), _sequential(), x):
        torch.testing.assert_close(got, model(xi))


@pytest.mark.parametrize(
    "make,tokens",
    [
        (
            lambda: wt.fuse(_sequential(), strategy="surgery", unfused=["9"]),
            ["unknown layer in unfused= '9'", "0, 1, 2"],
        ),
        (lambda: wt.fuse(_sequential(), strategy="surgery", unfused=["1"]), ["1 is no layer surgery swaps", "0, 2"]),
        (lambda: wt.fuse(_sequential(), unfused="2"), ["unfused='2'", "a list of layer names"]),
        (lambda: wt.fuse(linears(), unfused=["weight"]), ["inside a model fused by surgery", "gemm"]),
    ],
)
def test_unfused_names_only_layers_surgery_swaps(make, tokens):
    with pytest.raises(wt.WideTesseraError) as e:
        make()
    for token in tokens:
        assert token in str(e.value), (token, str(e.value))
