"""The names the runner gives its own callables, which no strategy may take: the N separate calls
(`baseline`), the whole point (`point`, for failures), and the controls.

The controls are the baseline loop made cheaper without fusing (measurement.controls builds
them); they are timed and checked like strategies, but never win.
"""

from __future__ import annotations

__all__ = ["BASELINE", "POINT", "CONTROLS", "RESERVED_NAMES"]

BASELINE, POINT = "baseline", "point"

# name: what it does, as tables explain it
CONTROLS = {
    "loop_graph": "the N calls captured in one CUDA graph (CUDA, inference)",
    "loop_compiled": "the N calls compiled with torch.compile's default mode",
    "loop_foreach": "the N calls, all N models stepped by one foreach optimizer (train_step, train)",
    "loop_fused": "the N calls, all N models stepped by one fused optimizer (train_step, train)",
}

RESERVED_NAMES = (BASELINE, POINT, *CONTROLS)
