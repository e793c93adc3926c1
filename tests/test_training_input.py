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
