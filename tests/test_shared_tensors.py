"""A frozen tensor N models hold is held once by fuse()'s wide module (core.layout.held_once,
SHARED): N adapted models over one frozen base train as N separate torch trainings would, the
wide module holding the base once and the models given back holding it once."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_tessera as wt
import wide_tessera.optim as wto
from wide_tessera.core.layout import held_once, slots_of

N, D, OUT = 3, 16, 4
LRS = [1e-2, 3e-3, 1e-3]


class Adapted(nn.Module):
    """A trainable head over a base: the base layer called."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base, self.head = base, nn.Linear(D, OUT)

    def forward(self, x):
        return self.head(torch.relu(self.base(x)))


class ReadsBase(Adapted):
    """The base's tensors read outside its layer's call."""

    def forward(self, x):
        return self.head(torch.relu(F.linear(x, self.base.weight, self.base.bias)))


class Branches(Adapted):
    """A forward that differs between train and eval: torch.fx traces one mode, so surgery
    captures it with torch.export."""

    def forward(self, x):
        return super().forward(x * 1.0 if self.training else x)


def frozen_base() -> nn.Linear:
    return nn.Linear(D, D).requires_grad_(False)


def adapted(cls, how: str):
    """N models over a frozen base: one object ('one'), or each its own bitwise copy ('equal')."""
    torch.manual_seed(0)
    base = frozen_base()
    return [cls(base if how == "one" else copy.deepcopy(base)) for _ in range(N)]


def held_bases(fused):
    """The tensors of the fused module's state shaped as one base weight or as N of them."""
    return [t for t in fused.state_dict().values() if t.shape[-2:] == (D, D)]


def wide_grads(fused):
    """Each model's gradients, by its parameter names, read through the wide module's slots."""
    params = dict(fused.named_parameters())
    grads = [{} for _ in range(N)]
    for key, slot in slots_of(fused).items():
        p = params.get(key)
        if p is not None and p.grad is not None:
            for i, part in enumerate(slot.layout.parts(p.grad, N)):
                grads[i][slot.name] = part
    return grads


@pytest.mark.parametrize("cls", [Adapted, ReadsBase, Branches])
@pytest.mark.parametrize("how", ["one", "equal"])
@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_a_frozen_base_is_held_once_and_trains_as_n_separate_trainings(strategy, how, cls):
    models = adapted(cls, how)
    for m in models:
        m.train()
    before = models[0].base.weight.clone()
    separate = [copy.deepcopy(m) for m in models]
    torch_opts = [torch.optim.AdamW(m.head.parameters(), lr=lr) for m, lr in zip(separate, LRS)]
    fused = wt.fuse(models, strategy=strategy)
    if strategy == "surgery":
        assert (fused.runs.captured is not None) == (cls is Branches)
        assert fused.runs.folded == ([] if cls is ReadsBase else ["base"])
    (held,) = held_bases(fused)
    assert held.shape == (D, D) and held.data_ptr() == models[0].base.weight.data_ptr()  # the models' own
    opt = wto.AdamW(fused, lr=LRS)
    torch.manual_seed(1)
    for _ in range(3):
        xs = [torch.randn(5, D) for _ in range(N)]
        outs = fused.unpack(fused(fused.pack(xs)))
        sum(o.square().sum() for o in outs).backward()
        for m, x, o in zip(separate, xs, outs):
            expected = m(x)
            torch.testing.assert_close(o, expected)
            expected.square().sum().backward()
        for got, m in zip(wide_grads(fused), separate):
            assert set(got) == {"head.weight", "head.bias"}  # the base none
            for name, p in m.named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(got[name], p.grad)
        opt.step()
        opt.zero_grad()
        for o in torch_opts:
            o.step()
            o.zero_grad()
    assert torch.equal(models[0].base.weight, before) and models[0].base.weight.grad is None
    back = fused.unfuse()
    assert len({id(m.base.weight) for m in back}) == 1  # given back once
    for got, m in zip(back, separate):
        for name, t in m.state_dict().items():
            torch.testing.assert_close(got.state_dict()[name], t)


@pytest.mark.parametrize("strategy", ["vmap", "surgery"])
def test_a_base_that_trains_is_each_models_own(strategy):
    """One object that trains is not held once: N trainings step N copies apart."""
    torch.manual_seed(0)
    base = nn.Linear(D, D)
    fused = wt.fuse([Adapted(base) for _ in range(N)], strategy=strategy)
    (held,) = held_bases(fused)
    assert held.shape == (N, D, D) and held.requires_grad is False  # (a state_dict's tensors are detached)
    assert all(p.requires_grad for p in fused.parameters())


# (what the N models hold, whether it is held once)
HELD_ONCE = {
    "one frozen object": (lambda p: [p, p], True),
    "frozen, bitwise equal": (lambda p: [p, copy.deepcopy(p)], True),
    "frozen, -0.0 for 0.0": (lambda p: [p, nn.Parameter(torch.where(p == 0, -0.0, p), requires_grad=False)], False),
    "frozen, one value apart": (lambda p: [p, nn.Parameter(p + 1, requires_grad=False)], False),
    "frozen, another dtype": (lambda p: [p, nn.Parameter(p.double(), requires_grad=False)], False),
    "one object that trains": (lambda p: [p.requires_grad_(True)] * 2, False),
    "a buffer": (lambda p: [p.detach(), p.detach()], False),
}


@pytest.mark.parametrize("case", list(HELD_ONCE))
def test_held_once(case):
    make, once = HELD_ONCE[case]
    p = nn.Parameter(torch.tensor([0.0, 1.5, -2.0]), requires_grad=False)
    assert held_once(make(p)) is once


BASE = frozen_base()


def over_one_base() -> Adapted:
    return Adapted(BASE)


@pytest.mark.parametrize("mode", ["inference", "train_step"])
def test_benchmark_custom_checks_models_over_one_frozen_base(mode, fast_timing):
    """Its train mode trains copies of the models (equal bases, held once) and checks them
    against the separate trainings: correct either way."""
    r = wt.benchmark_custom(over_one_base, (5, D), [3], mode=mode, verbose=False, timing=fast_timing, confirm="none")
    point = r.points[0]
    assert point.correct == {"vmap": True, "surgery": True}, {s: c.error for s, c in point.checks.items()}
    assert "held once 1 layers (Linear x1)" in point.checks["surgery"].ran
