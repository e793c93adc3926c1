"""Fusing computes what the N separate calls compute, and leaves the models as they were, or
says why not: the user's modules are never run by a capture, a layer is swapped for an op's wide
module only when it computes that op, and what torch's vmap cannot run is skipped with the reason."""

import copy
import pickle

import pytest
import torch
from torch import nn

from wide_tessera.widen.surgery import WideSurgery


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
