"""A model both captures take (torch.fx and torch.export, widen/capture.py) runs the same rewritten
graph whichever captured it: the same layers, and between them the ops themselves, with no more
calls around them on the export path than on the fx path."""

from typing import List

import pytest
import torch
from torch import nn

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
