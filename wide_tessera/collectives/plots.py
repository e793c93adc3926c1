"""Pictures of a collectives run: per dtype and placement, each collective's time and bus bandwidth against the
message size."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

from ..reports.plots import FORMATS, figure_class, log_axis, save_figure
from .cases import CollectivesRun

__all__ = ["plot_collectives"]


def plot_collectives(run: "CollectivesRun", directory: Path, formats: Sequence[str] = FORMATS) -> List[Path]:
    """One figure per dtype and placement: each collective's time and bus bandwidth against the
    message size (log2), the time with its 95% CI; incorrect cases are left out."""
    written = []
    for dtype, placement in dict.fromkeys((r.dtype, r.placement) for r in run.results):
        fig = figure_class()(figsize=(12, 4.5), layout="constrained")
        time, bandwidth = fig.subplots(1, 2)
        for i, op in enumerate(dict.fromkeys(r.op for r in run.results)):
            rs = [r for r in run.results if (r.op, r.dtype, r.placement) == (op, dtype, placement) and r.correct]
            if not rs:
                continue
            x = [r.size_bytes for r in rs]
            us = [r.stats.median_ms * 1e3 for r in rs]
            err = [
                [u - r.stats.median_ci_ms[0] * 1e3 for u, r in zip(us, rs)],
                [r.stats.median_ci_ms[1] * 1e3 - u for u, r in zip(us, rs)],
            ]
            time.errorbar(x, us, yerr=err, label=op, color=f"C{i}", marker="o", markersize=4, capsize=2)
            bandwidth.plot(x, [r.busbw_gbps for r in rs], label=op, color=f"C{i}", marker="o", markersize=4)
        time.set_yscale("log")
        log_axis(time.yaxis)
        time.set_title("median time per call, the slowest rank's (95% CI)", fontsize=9)
        time.set_ylabel("us")
        bandwidth.set_title("bus bandwidth (nccl-tests' busbw)", fontsize=9)
        bandwidth.set_ylabel("GB/s")
        for ax in (time, bandwidth):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size S (bytes)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(
            f"collectives: {run.ranks} ranks, {run.backend}, {dtype}, "
            f"{placement}\n{', '.join(sorted(set(run.devices)))}",
            fontsize=11,
        )
        written += save_figure(fig, Path(directory), f"collectives_{dtype}_{placement}", formats)
    return written
