"""Does wide_tessera.measure agree with the timers people already trust?

Times reference workloads (matmuls and convolutions from microseconds to tens of
milliseconds) with the timer the runner and `measure` use (`measure_paired`) and
torch.utils.benchmark's Timer.blocked_autorange (and
triton.testing.do_bench on CUDA), and prints each pair's medians and ratio.
Target: within 5% on a CPU, 3% of do_bench on a GPU where launch overhead is
small against the kernel: our CUDA timer starts on an idle GPU and counts the
host's launch cost, which do_bench hides behind its queue, so microsecond
kernels read longer by design.

    python scripts/timer_fidelity.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
from torch.utils import benchmark as torch_benchmark

from wide_tessera.measurement.timing import measure_paired
from wide_tessera.reports.text import format_table


def workloads(device: str) -> List[Tuple[str, Callable[[], object]]]:
    def mm(n: int) -> Callable[[], object]:
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        return lambda: a @ b

    def conv(batch: int, ch: int, size: int) -> Callable[[], object]:
        x = torch.randn(batch, ch, size, size, device=device)
        w = torch.randn(ch, ch, 3, 3, device=device)
        return lambda: F.conv2d(x, w, padding=1)

    sizes = [64, 256, 512, 1024] if device == "cpu" else [256, 1024, 4096, 8192]
    convs = [(1, 16, 32), (4, 32, 64), (8, 64, 64)] if device == "cpu" else [(8, 64, 64), (32, 128, 128), (64, 256, 64)]
    return [(f"matmul {n}x{n}", mm(n)) for n in sizes] + [
        (f"conv2d b{b} c{c} {s}x{s}", conv(b, c, s)) for b, c, s in convs
    ]


ROUNDS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    cuda = device.startswith("cuda")
    rows, worst = [], 0.0
    with torch.no_grad():
        for name, fn in workloads(device):
            # Timer runs single-threaded unless told otherwise: give it the threads we measure with.
            timer = torch_benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            timer.blocked_autorange(min_run_time=0.5)  # warm up, so neither timer pays for the first calls
            ours, ref, bench = [], [], []
            for _ in range(ROUNDS):  # alternate the timers, so drift in the machine hits both alike
                ours.append(measure_paired({"fn": fn}, device).stats["fn"])
                ref.append(timer.blocked_autorange(min_run_time=1.0).median * 1e3)
                if cuda:
                    import triton.testing

                    bench.append(triton.testing.do_bench(fn, return_mode="median"))
            our_ms = statistics.median(m.median_ms for m in ours)
            ref_ms = statistics.median(ref)
            ratio = our_ms / ref_ms
            worst = max(worst, abs(ratio - 1))
            row = [
                name,
                ours[0].timer,
                f"{our_ms:.4g}",
                f"{ref_ms:.4g}",
                f"{ratio:.3f}",
                f"{max(ref) / min(ref) - 1:.1%}",
            ]
            if cuda:
                row += [f"{statistics.median(bench):.4g}", f"{our_ms / statistics.median(bench):.3f}"]
            rows.append(row)
    header = ["workload", "our timer", "ours ms", "torch.utils.benchmark ms", "ratio", "torch's own spread"]
    if cuda:
        header += ["do_bench ms", "ratio to do_bench"]
    print(f"device: {device}, threads: {torch.get_num_threads()}, torch {torch.__version__}")
    print(
        f"medians of {ROUNDS} alternating rounds; torch's own spread: its largest/smallest round - 1 (the noise floor)"
    )
    print(format_table(header, rows))
    print(f"largest deviation from torch.utils.benchmark: {worst:.1%}")


if __name__ == "__main__":
    main()
