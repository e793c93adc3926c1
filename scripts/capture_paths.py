"""Which capture should surgery try first: torch.fx or torch.export?

Surgery captures one model's graph with torch.fx where it can trace forward, else with
torch.export (widen/capture.py). For each layer: whether torch.fx traces it (and torch's words
where it does not), what building the wide model costs each way (torch.export captures on the
first call, so that call is included), and the median of interleaved calls of each, with the
largest difference between their outputs. Hand-written layers that torch.fx traces come first,
then the real layers of scripts/real_modules.py (most transformers layers defeat torch.fx).
Pin it for quotable numbers:

    taskset -c 1 python scripts/capture_paths.py [--n 16] [--hidden 64] [--held-out]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch
from real_modules import Sizes, catalogue, held_out
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from wide_tessera.reports.text import format_table
from wide_tessera.widen.exported import ExportedSurgery
from wide_tessera.widen.surgery import WideSurgery


class Mlp(nn.Module):
    """Two linears and a GELU: the shape of most experts and ensemble members."""

    def __init__(self, d: int):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class ConvBlock(nn.Module):
    """A residual convolution block of a small CNN."""

    def __init__(self, d: int):
        super().__init__()
        c = max(4, d // 8)
        self.conv, self.norm = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


def hand_written(s: Sizes) -> Dict[str, Tuple[Callable[..., nn.Module], Dict[str, Any], Callable[[], Any]]]:
    c = max(4, s.hidden // 8)
    return {
        "Mlp": (Mlp, {"d": s.hidden}, s.states),
        "ConvBlock": (ConvBlock, {"d": s.hidden}, lambda: torch.randn(s.batch, c, 16, 16)),
    }


def interleaved_medians(calls: List[Callable[[], Any]], rounds: int = 31) -> List[float]:
    """Each call's median seconds over `rounds` rounds, the calls taken in turn within a round."""
    times: List[List[float]] = [[] for _ in calls]
    for _ in range(3):
        for call in calls:
            call()
    for _ in range(rounds):
        for t, call in zip(times, calls):
            started = time.perf_counter()
            call()
            t.append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def row(name: str, make: Callable[..., nn.Module], kwargs: Dict[str, Any], one: Callable[[], Any], n: int) -> List[str]:
    torch.manual_seed(0)
    models = [make(**kwargs).eval() for _ in range(n)]
    x = one()
    args, kw = (x, {}) if isinstance(x, tuple) else ((), x) if isinstance(x, dict) else ((x,), {})
    wide_args, wide_kw = tree_map(lambda t: torch.stack([t] * n) if isinstance(t, torch.Tensor) else t, (args, kw))
    with torch.no_grad():
        started = time.perf_counter()
        surgery = WideSurgery(models)
        surgery(*wide_args, **wide_kw)
        built_s = time.perf_counter() - started
        started = time.perf_counter()
        exported = ExportedSurgery(models, "error", "(forced)")
        exported(wide_args, wide_kw)
        export_s = time.perf_counter() - started
        loop = lambda: [m(*args, **kw) for m in models]  # noqa: E731
        fx_call = lambda: surgery(*wide_args, **wide_kw)  # noqa: E731
        export_call = lambda: exported(wide_args, wide_kw)  # noqa: E731
        medians = interleaved_medians([loop, fx_call, export_call])
        difference = max(
            (a - b).abs().max().item()
            for a, b in zip(tree_flatten(fx_call())[0], tree_flatten(export_call())[0])
            if isinstance(a, torch.Tensor)
        )
    traced = surgery.captured is None
    why = "-" if traced else surgery.captured.why_not_fx[:60]
    fx_build = f"{built_s * 1e3:.0f}" if traced else "-"
    fx_time = f"{medians[1] * 1e3:.3f}" if traced else "-"
    ratio = f"{medians[2] / medians[1]:.2f}x" if traced else "-"
    return [name, why, fx_build, f"{export_s * 1e3:.0f}", f"{medians[0] * 1e3:.3f}", fx_time,
            f"{medians[2] * 1e3:.3f}", ratio, f"{difference:.1e}"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--held-out", action="store_true", help="also the layers of real_modules.held_out()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # a standalone layer's note on its attention implementation
    s = Sizes(args.hidden, args.seq, args.batch)
    layers = {**hand_written(s), **catalogue(s), **(held_out(s) if args.held_out else {})}
    rows = [row(name, *layer, args.n) for name, layer in layers.items() if "Moe" not in name]
    print(f"N={args.n}, hidden {s.hidden}, {s.batch} x {s.seq} tokens, 1 thread, torch {torch.__version__}")
    header = ["layer", "torch.fx cannot trace it", "fx: build ms", "export: build ms", "loop ms", "fx ms",
              "export ms", "export/fx", "fx-export"]  # fmt: skip
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
