"""The N axis of each value of a captured graph, marked once in node.meta (widen/n_axis.py), and
the wide model built on the marks computing what N separate calls compute."""

import pytest
import torch
from torch import nn

from wide_tessera.widen.n_axis import N_AXIS
from wide_tessera.widen.surgery import WideSurgery


class _Mixed(nn.Module):
    """Values of every kind: the input, a layer's output, a shape query, a constant made in
    forward, a frozen table every model holds, and what is computed from them."""

    def __init__(self, table: nn.Parameter):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.size(-1)
        offset = torch.ones(4) * self.table
        return self.lin(x) * scale + offset


def _models(n: int):
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(4), requires_grad=False)  # one frozen tensor: held once
    return [_Mixed(table) for _ in range(n)]


@pytest.mark.parametrize(
    "node, n_axis",
    [
        ("x", 0),  # an input: each model's own
        ("size", None),  # a shape query answers for one model
        ("_tensor_constant0", None),  # a constant made in forward (torch.ones(4))
        ("table", None),  # a frozen tensor every model holds, held once
        ("mul", None),  # computed from shared values alone
        ("lin", 0),  # a layer holding each model's weights
        ("mul_1", 0),  # computed from a model's own value
        ("add", 0),
    ],
)
def test_each_value_of_torch_fx_graph_is_marked_with_its_n_axis(node, n_axis):
    wide = WideSurgery(_models(3))
    marks = {n.name: n.meta[N_AXIS] for n in wide.graph_module.graph.nodes if n.op != "output"}
    assert marks[node] == n_axis, marks


def test_the_marked_graph_computes_what_the_models_compute():
    models = _models(3)
    xs = [torch.randn(2, 4) for _ in models]
    wide = WideSurgery(models)
    out = wide.unpack(wide(wide.pack(xs)))
    for model, x, o in zip(models, xs, out):
        torch.testing.assert_close(o, model(x))


class _ActivatedConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.act(torch.ones(4) - 0.5)


def test_an_activation_of_values_all_models_share_gives_a_value_they_share():
    """It was taken for each model's own: the constant's [4] met the stacked [N, 2, 4] as if it
    were N models' rows (torch's size mismatch)."""
    torch.manual_seed(0)
    models = [_ActivatedConstant() for _ in range(3)]
    xs = [torch.randn(2, 4) for _ in models]
    wide = WideSurgery(models)
    marks = {n.name: n.meta[N_AXIS] for n in wide.graph_module.graph.nodes}
    assert marks["act"] is None and marks["add"] == 0
    for model, x, o in zip(models, xs, wide.unpack(wide(wide.pack(xs)))):
        torch.testing.assert_close(o, model(x))

