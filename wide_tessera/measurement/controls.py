"""Controls: the baseline loop made cheaper without fusing anything, timed beside the strategies.

Much of a fused op's gain on a GPU is launch overhead: N separate calls pay the
host's launch cost N times. Capturing the loop in one CUDA graph, or compiling it,
removes most of that overhead while the N problems stay separate. Timed beside the
strategies, the controls answer "fuse, or just capture the loop?". They are checked
like strategies but are never winners: they do not fuse.

In train_step and train a loop of N models also pays N optimizer steps of a few small tensors each.
torch's foreach (multi-tensor) and fused optimizers step all N models' parameters in a
few kernels, without fusing the models: "fuse, or just step them together?". They are
controls, not strategies: no wide module comes out of them for `fuse` to build, and
every op has them alike.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

from ..core import trees
from ..core.roles import CONTROLS
from .timing import capture_graph

__all__ = [
    "OPTIMIZER_CONTROLS",
    "legend",
    "COMPILE_MODES",
    "BACKWARD_NOT_COMPILED",
    "control_unavailable",
    "GraphedLoop",
    "compiled",
]

# the optimizer implementation each optimizer control steps the N models with
OPTIMIZER_CONTROLS = {"loop_foreach": "foreach", "loop_fused": "fused"}
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")

# torch.compile's backward frees the tensors its forward saved ("donated buffers"), so the
# backward of one recorded forward cannot run twice (torch 2.13: a RuntimeError on the second).
BACKWARD_NOT_COMPILED = (
    "compiled code frees what its forward saved after one backward, so the backward mode, which times the "
    "backward of one recorded forward again and again, cannot time it; time forward_backward instead"
)

Loop = Callable[[Sequence[torch.Tensor]], List[torch.Tensor]]


def control_unavailable(
    name: str, device: str, compile_mode: str, cuda_graph: bool, random: bool = False, mode: str = "inference"
) -> Optional[str]:
    """Why control `name` is not run in this setting, or None when it is.

    `random`: the models draw random numbers. A compiled loop draws them its own way and a
    graph replays one capture's draws, so neither could be checked against the eager calls.
    `mode`: the loop is captured for inference only; capturing a backward pass and an
    optimizer step is whole-network graph capture, which this control does not do. The
    compiled loop cannot be timed in the backward mode (see BACKWARD_NOT_COMPILED). The
    optimizer controls step an optimizer, which only train_step and train have.
    """
    if name in OPTIMIZER_CONTROLS:
        return (
            None
            if mode in ("train_step", "train")
            else f"steps an optimizer, which only train_step and train have; this run's mode is {mode}"
        )
    if random:
        return "the models draw random numbers, which a compiled or captured loop draws its own way"
    if name == "loop_graph" and mode != "inference":
        return f"captures the inference loop only; this run's mode is {mode}"
    if name == "loop_graph":
        if torch.device(device).type != "cuda":
            return f"needs a CUDA device; this run is on {device}"
        if cuda_graph:
            return "every side is timed as a CUDA-graph replay already (--cuda-graph)"
    if name == "loop_compiled" and mode == "backward":
        return BACKWARD_NOT_COMPILED
    if name == "loop_compiled" and compile_mode != "none":
        return f"every side is compiled already (--compile {compile_mode})"
    return None


def legend(names: Sequence[str]) -> str:
    """'loop_graph: the N calls captured in one CUDA graph ..., ...' for the controls `names`."""
    return ", ".join(f"{c}: {CONTROLS[c]}" for c in names)


def compiled(fn: Callable, mode: str) -> Callable:
    """`fn` under torch.compile in `mode` ('default' is torch's default mode)."""
    return torch.compile(fn, mode=None if mode == "default" else mode)


class GraphedLoop:
    """The loop over N separate calls captured in one CUDA graph over static inputs.

    `load(inputs)` copies inputs into the static ones (outside any timed region);
    `replay()` runs the captured calls and returns the static outputs, which the next
    replay overwrites.
    """

    def __init__(self, loop: Loop, inputs: Sequence[Any]):
        self.inputs = [trees.clone(x) for x in inputs]
        self._replay, self.outputs = capture_graph(lambda: loop(self.inputs))

    def load(self, inputs: Sequence[Any]) -> None:
        for static, x in zip(trees.tensors(self.inputs), trees.tensors(inputs)):
            static.copy_(x)

    def replay(self) -> List[torch.Tensor]:
        self._replay()
        return self.outputs
