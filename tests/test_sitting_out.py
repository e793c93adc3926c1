"""A model left out of a step's loss, trained through fuse() and wide_tessera.optim, is skipped as
N separate torch models with N torch optimizers skip it: its `grad` is None there, so no weight
decay, momentum, moment decay or step count moves, clipping sees no gradient of it, and its
optimizer state is not made or advanced. A model in the loss whose gradient is zero is stepped,
as torch steps it. Every row trains both ways for a few steps and compares each model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_tessera as wt
import wide_tessera.optim as wto
from wide_tessera.dispatch.table import DispatchTable
from wide_tessera.widen.custom import model_identity

from .helpers import entry

N, D, H, B, STEPS = 4, 8, 16, 4, 5
# the models each step leaves out of the loss: model 2 sits out its first step (its state is made
# later), model 1 sits out three steps, two of them in a row, model 3 and model 0 one each
SAT_OUT = [{2}, {1}, {1, 3}, {0}, {1}]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, 1)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(F.relu(self.fc1(x)))))


def _partial_table():
    """A table that fuses the MLP by surgery and keeps its fc2 as N calls (its op loses at 16 -> 16):
    fc2's weights are each one model's own tensors inside a wide module."""
    gemm = {"batch": B}
    return DispatchTable([
        entry(op="MLP", params={k: v for k, v in model_identity(MLP()).items() if k != "class"},
              strategy="surgery", verdicts="loop:1 fuse:4"),
        entry(params={**gemm, "in_features": D, "out_features": H}, verdicts="loop:1 fuse:4"),
        entry(params={**gemm, "in_features": H, "out_features": H}, verdicts="loop:1 fuse:2 loop:4"),
        entry(params={**gemm, "in_features": H, "out_features": 1}, verdicts="loop:1 fuse:4"),
    ])  # fmt: skip


# strategy -> (the models, how fuse() is asked for it)
STRATEGIES = {
    "loop": (MLP, {"strategy": "loop"}),
    "vmap": (MLP, {"strategy": "vmap"}),
    "surgery": (MLP, {"strategy": "surgery"}),
    "bmm": (lambda: nn.Linear(D, 1), {"strategy": "bmm"}),
    "surgery, fc2 as N calls": (MLP, {"table": _partial_table}),
    "surgery, fc2 named unfused": (MLP, {"strategy": "surgery", "unfused": ["fc2"]}),
}

# kind -> (torch's optimizer of one model, ours over the fused module); settings that move a
# model even where its gradient is zero: weight decay, momentum, moments
KINDS = {
    "SGD": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
        lambda f: wto.SGD(f, lr=0.1, momentum=0.9, weight_decay=0.1),
    ),
    "SGD nesterov": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, weight_decay=0.05, nesterov=True),
        lambda f: wto.SGD(f, lr=0.1, momentum=0.5, weight_decay=0.05, nesterov=True),
    ),
    "Adam": (
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
        lambda f: wto.Adam(f, lr=0.01, weight_decay=0.1),
    ),
    "Adam foreach": (
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=True),
        lambda f: wto.Adam(f, lr=0.01, weight_decay=0.1, implementation="foreach"),
    ),
    "Adam amsgrad": (
        lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
        lambda f: wto.Adam(f, lr=0.01, amsgrad=True),
    ),
    "Adadelta": (
        lambda ps: torch.optim.Adadelta(ps, lr=0.5, weight_decay=0.1),
        lambda f: wto.Adadelta(f, lr=0.5, weight_decay=0.1),
    ),
    "AdamW": (
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda f: wto.AdamW(f, lr=0.01, weight_decay=0.1),
    ),
}


def _term(what, out):
    """One model's term of the loss: its output's (`out`), the same times zero (`zero`: a gradient
    of zeros), or none (None: left out, its gradient None in torch)."""
    return out.pow(2).mean() * (0.0 if what == "zero" else 1.0)


def _train_both(strategy, kind, terms, clip=True):
    """The models trained separately (each by torch) and fused (by ours), `terms(t)` giving each
    model's term of step t's loss (`_term`) and whether a penalty on every model's parameters is
    added to it. Returns both, our optimizer and theirs, and the norms each clipped."""
    make, how = STRATEGIES[strategy]
    torch_opt, our_opt = KINDS[kind]
    torch.manual_seed(0)
    models = [make() for _ in range(N)]
    xs = [torch.randn(STEPS, B, D) for _ in range(N)]
    fused = wt.fuse(copy.deepcopy(models), **{k: v() if callable(v) else v for k, v in how.items()})
    assert fused.decision.fused == (strategy != "loop")
    opt = our_opt(fused)
    separate = copy.deepcopy(models)
    theirs = [torch_opt(m.parameters()) for m in separate]
    norms, their_norms = [], []
    for t in range(STEPS):
        outs = fused.unpack(fused(fused.pack([x[t] for x in xs])))
        what, penalty = terms(t)
        loss = sum(_term(w, out) for w, out in zip(what, outs) if w is not None)
        (loss + _penalty(fused) if penalty else loss).backward()
        if clip:
            norms.append(wto.clip_grad_norm_(fused, 0.5))
        opt.step()
        opt.zero_grad()
        their_norm = []
        for i, (m, o) in enumerate(zip(separate, theirs)):
            loss = 0 if what[i] is None else _term(what[i], m(xs[i][t]))
            if penalty or what[i] is not None:
                (loss + _penalty(m) if penalty else loss).backward()
            their_norm.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) if clip else torch.tensor(0.0))
            o.step()
            o.zero_grad()
        their_norms.append(torch.stack(their_norm))
    return fused, separate, opt, theirs, norms, their_norms


def _penalty(module):
    return sum(p.pow(2).sum() for p in module.parameters())


def _sat_out(t):
    return [None if i in SAT_OUT[t] else "out" for i in range(N)], False


SCENARIOS = {
    # every model in the loss, the ones SAT_OUT names times zero: a gradient of zeros, stepped
    "a gradient of zeros": lambda t: (["zero" if i in SAT_OUT[t] else "out" for i in range(N)], False),
    # the ones SAT_OUT names out of the outputs' loss, a penalty on every model's parameters: each has a gradient
    "a penalty on the parameters": lambda t: (_sat_out(t)[0], True),
}


def _farthest(fused, separate):
    return max(
        (a - b).abs().max().item()
        for u, s in zip(fused.unfuse(), separate)
        for a, b in zip(u.parameters(), s.parameters())
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_model_left_out_of_the_loss_is_skipped_as_torch_skips_it(strategy, kind):
    """SGD with momentum and weight decay ended 0.045 from the separate trainings after 5 steps,
    Adam 0.046, AdamW 0.026 (vmap and surgery; the loop was right): the models that sat out were
    stepped on a gradient of zeros."""
    fused, separate, opt, theirs, norms, their_norms = _train_both(strategy, kind, _sat_out)
    assert _farthest(fused, separate) < 1e-6
    torch.testing.assert_close(torch.stack(norms).float(), torch.stack(their_norms).float())
    for i, (ours, torch_opt) in enumerate(zip(opt.state_dicts(), theirs)):  # states made, and steps counted, alike
        want = torch_opt.state_dict()["state"]
        assert sorted(ours["state"]) == sorted(want), i
        for j, state in want.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(ours["state"][j][key].float(), value.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("strategy", ["vmap", "bmm", "surgery, fc2 as N calls"])
def test_a_model_with_a_gradient_is_stepped_as_torch_steps_it(strategy, scenario, kind):
    """A model in the loss with a gradient of zeros, or out of the outputs' loss but with a
    penalty on its parameters, has a gradient in torch, which steps it: so do we."""
    fused, separate, *_ = _train_both(strategy, kind, SCENARIOS[scenario])
    assert _farthest(fused, separate) < 1e-6


def test_gradients_accumulated_over_two_backwards_count_every_model_either_reached():
    """Two backwards before a step (micro-batches), each leaving a different model out: both have
    a gradient, as in torch; a zero_grad() starts the record again."""
    torch.manual_seed(0)
    fused = wt.fuse([MLP() for _ in range(N)], strategy="vmap")
    x = fused.pack([torch.randn(B, D) for _ in range(N)])
    for left_out in ({0, 1}, {1, 2}):
        outs = fused.unpack(fused(x))
        sum(out.sum() for i, out in enumerate(outs) if i not in left_out).backward()
    assert fused.models_reached() == {0, 2, 3}
    fused.zero_grad()
    assert fused.models_reached() is None
    fused(x).sum().backward()  # the wide output as a whole, never unpacked: every model
    assert fused.models_reached() == set(range(N))


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
@pytest.mark.parametrize("strategy", ["vmap", "bmm", "surgery"])
def test_a_model_reached_through_the_whole_output_is_stepped_beside_the_parts(strategy, kind):
    """A loss of some models' unpacked outputs plus a term of the wide output as a whole reaches
    every model, as N separate models each in that term: the parts' hooks alone counted only the
    models whose parts were used, and skipped the others' steps (a silent fault of its own)."""
    make, how = STRATEGIES[strategy]
    torch_opt, our_opt = KINDS[kind]
    torch.manual_seed(0)
    models = [make() for _ in range(N)]
    xs = [torch.randn(STEPS, B, D) for _ in range(N)]
    fused = wt.fuse(copy.deepcopy(models), **how)
    opt = our_opt(fused)
    separate = copy.deepcopy(models)
    theirs = [torch_opt(m.parameters()) for m in separate]
    for t in range(STEPS):
        wide = fused(fused.pack([x[t] for x in xs]))
        outs = fused.unpack(wide)
        loss = sum(_term("out", out) for i, out in enumerate(outs) if i not in SAT_OUT[t])
        (loss + 0.01 * wide.pow(2).sum()).backward()
        assert fused.models_reached() == set(range(N))
        opt.step()
        opt.zero_grad()
        for i, (m, o) in enumerate(zip(separate, theirs)):
            out = m(xs[i][t])
            (0.01 * out.pow(2).sum() + (0 if i in SAT_OUT[t] else _term("out", out))).backward()
            o.step()
            o.zero_grad()
    assert _farthest(fused, separate) < 1e-6


@pytest.mark.parametrize("cleared", ["a parent's zero_grad", "p.grad = None", "torch.autograd.grad"])
def test_gradients_set_to_none_elsewhere_start_the_record_again(cleared):
    """The record was cleared by the fused module's own zero_grad() alone: gradients set to None
    by a parent module, by hand, or never filled (torch.autograd.grad through the outputs, as an
    adversarial step takes them) left earlier steps' models marked, and a model that then sat
    out was stepped (0.399 off its separate training)."""
    torch.manual_seed(0)
    fused = wt.fuse([MLP() for _ in range(N)], strategy="vmap")
    parent = nn.ModuleList([fused])
    x = fused.pack([torch.randn(B, D) for _ in range(N)])
    sum(out.sum() for out in fused.unpack(fused(x))).backward()  # every model
    if cleared == "a parent's zero_grad":
        parent.zero_grad()
    elif cleared == "p.grad = None":
        for p in fused.parameters():
            p.grad = None
    else:
        parent.zero_grad()
        x_in = torch.randn(N, B, D, requires_grad=True)
        outs = fused.unpack(fused(fused.pack(list(x_in.unbind()))))
        torch.autograd.grad(sum(out.sum() for out in outs), x_in)
    outs = fused.unpack(fused(x))
    outs[1].sum().backward()  # model 1 alone
    assert fused.models_reached() == {1}
